#!/usr/bin/env python3
"""`runsc run` started by hand on the same kind of bundle pboxd's gVisor runtime writes.

The peer of `pbox-bench --runtime gvisor`: no agent, no gRPC, no cgroups. Each sandbox is a
bundle whose rootfs is an OverlayFS of the "host" image skeleton (--skeleton, e.g. the one a
pboxd state dir holds at images/host) with /usr bound read-only, and pbox-init --stream as
PID 1; the script speaks pbox-init's stream protocol (init_protocol.h) itself.

Measures, with N sandboxes live: create (runsc run until pbox-init's Ready) and exec of
`true` and `python3 -c pass` (Spawn until Exited), p50/p99 in ms. Run as root.

  bench/peers/runsc_by_hand.py --init build/src/pbox/pbox-init \
      --skeleton /tmp/x/state/images/host --sandboxes 20 --rounds 3
"""
import argparse, json, os, shutil, struct, subprocess, sys, tempfile, time


def frame(typ, fid, payload):
    body = b"PBI" + bytes([1]) + struct.pack("<HHQ", typ, 0, fid) + payload
    return struct.pack("<I", len(body)) + body


def strlist(items):
    blob = b"".join(s.encode() + b"\0" for s in items)
    return struct.pack("<II", len(items), len(blob)) + blob


def spawn(fid, argv):
    flags = 1 | 2 | 4 | 8  # stdio /dev/null, stream transport
    cwd = b"/"
    return frame(1, fid, struct.pack("<I", flags) + struct.pack("<I", len(cwd)) + cwd +
                 strlist(argv) + strlist(["PATH=/usr/local/bin:/usr/bin:/bin"]))


class Sandbox:
    def __init__(self, root, name, args):
        self.dir = os.path.join(root, name)
        os.makedirs(self.dir + "/layer")
        os.makedirs(self.dir + "/rootfs")
        subprocess.check_call(["mount", "-t", "tmpfs", "-o", "size=1g", "pbox", self.dir + "/layer"])
        os.makedirs(self.dir + "/layer/upper")
        os.makedirs(self.dir + "/layer/work")
        subprocess.check_call(["mount", "-t", "overlay", "-o",
                               f"lowerdir={args.skeleton},upperdir={self.dir}/layer/upper,"
                               f"workdir={self.dir}/layer/work", "overlay", self.dir + "/rootfs"])
        os.makedirs(self.dir + "/rootfs/usr", exist_ok=True)
        subprocess.check_call(["mount", "--bind", "-o", "ro", "/usr", self.dir + "/rootfs/usr"])
        config = {
            "ociVersion": "1.0.0",
            "process": {"terminal": False, "user": {"uid": 0, "gid": 0},
                        "args": ["/dev/pbox-init", "--stream"],
                        "env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "cwd": "/",
                        "noNewPrivileges": True},
            "root": {"path": "rootfs", "readonly": False},
            "hostname": name,
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/tmp", "type": "bind", "source": self.dir + "/rootfs/tmp",
                 "options": ["rbind", "rw"]},
                {"destination": "/dev/pbox-init", "type": "bind", "source": args.init,
                 "options": ["bind", "ro"]},
            ],
            "linux": {"namespaces": [{"type": t} for t in
                                     ("pid", "network", "ipc", "uts", "mount")]},
        }
        with open(self.dir + "/config.json", "w") as f:
            json.dump(config, f)
        t = time.monotonic()
        self.proc = subprocess.Popen(
            [args.runsc, "--root", self.dir + "/runsc-root", "--platform", args.platform,
             "--network=none", "--file-access=shared", "--ignore-cgroups", "run",
             "--bundle", self.dir, name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(self.dir + "/runsc.log", "w"))
        try:
            typ = self.read()
        except struct.error:
            raise RuntimeError("runsc failed: " + open(self.dir + "/runsc.log").read()[-2000:])
        assert typ == 0x86, f"expected Ready, got {typ:#x}"
        self.create_ms = (time.monotonic() - t) * 1000
        self.next_id = 1

    def read(self):
        n = struct.unpack("<I", self.proc.stdout.read(4))[0]
        body = self.proc.stdout.read(n)
        return struct.unpack("<H", body[4:6])[0]

    def run(self, argv):
        t = time.monotonic()
        self.proc.stdin.write(spawn(self.next_id, argv))
        self.proc.stdin.flush()
        self.next_id += 1
        while self.read() != 0x83:
            pass
        return (time.monotonic() - t) * 1000

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()
        for m in ("/rootfs/usr", "/rootfs", "/layer"):
            subprocess.call(["umount", "-l", self.dir + m])


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", required=True)
    ap.add_argument("--skeleton", required=True)
    ap.add_argument("--runsc", default="runsc")
    ap.add_argument("--platform", default="ptrace")
    ap.add_argument("--sandboxes", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    args.init = os.path.abspath(args.init)
    args.skeleton = os.path.abspath(args.skeleton)
    root = tempfile.mkdtemp(prefix="runsc-by-hand-")
    boxes = []
    try:
        for i in range(args.sandboxes):
            boxes.append(Sandbox(root, f"hand-{i}", args))
        out = {"runtime": "runsc by hand", "sandboxes": len(boxes)}
        create = [b.create_ms for b in boxes]
        out["create"] = {"p50": pct(create, 50), "p99": pct(create, 99)}
        for label, argv in (("exec_true", ["true"]),
                            ("exec_python", ["python3", "-c", "pass"])):
            xs = [b.run(argv) for _ in range(args.rounds) for b in boxes]
            out[label] = {"p50": pct(xs, 50), "p99": pct(xs, 99)}
        out["loadavg"] = open("/proc/loadavg").read().split()[:3]
        print(json.dumps(out, indent=1))
    finally:
        for b in boxes:
            b.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
