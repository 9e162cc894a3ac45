#!/usr/bin/python3
"""Benchmark peer: `runsc run` started by hand on the same kind of OCI bundle pboxd's gVisor
runtime writes, measured the way pbox-bench measures pbox (same metrics, same tool scripts,
same JSON; see peerlib.py). The peer of `pbox-bench --runtime gvisor`: no agent, no gRPC, no
cgroups (so no memory limit), no image store.

    bench/peers/runsc_peer.py --sandboxes 10 --rounds 1 --tool-samples 4 --json OUT

Each sandbox is a bundle whose rootfs is an OverlayFS of a skeleton root (the one podman's peer
imports: peerlib.make_skeleton) over a private tmpfs, with the host's /usr bound read-only and
pbox-init --stream as PID 1; this script speaks pbox-init's stream protocol
(src/pbox/init/init_protocol.h) over runsc's stdin and stdout itself, which is the least any
program driving runsc must do to run commands in a live sandbox.

With --pin each sandbox's runsc (and so its gofer and sentry) is pinned to one CPU, in turn,
the CPUs pbox gives a sandbox by default (runsc_pinned_peer.py runs this in `make bench`).
With --cgroup (cgroup v1) it is placed instead, as pbox places it, in a cgroup of its own in
the cpu, cpuacct, cpuset (one CPU, in turn), memory (1 GiB limit), pids (512) and freezer
hierarchies, joined through `tasks` before `runsc` is executed.

- create: from the first step of the sandbox's bundle (its directories, the tmpfs, overlay and
  /usr mounts made with mount(2), config.json, and with --cgroup its cgroups) until pbox-init's
  Ready frame, the interval pbox-bench times for pbox (whose agent does the same steps inside
  CreateSandbox); `create_runsc_ms` is the `runsc run` -> Ready part of it alone;
- create_exec: create, then `true` run to its exit (the first command);
- exec: Spawn of `true` / `python3 -c pass` until its Exited frame;
- 1 MiB round trip: `cat > /tmp/bench.bin` fed by Stdin frames, then `cat /tmp/bench.bin`
  read back from Output frames, bytes checked; one sandbox at a time, then all at once;
- tools: `python3 /opt/bragg-tools/NAME.py SEED`, the scripts copied into the rootfs once.

pbox-init comes from --init, else $PBOX_INIT, else build/src/pbox/pbox-init (bench/pbox/run.py
sets $PBOX_INIT to its build's). Exit status 3 (skip) when not root, or runsc or pbox-init is
missing, or the first sandbox cannot start.
"""

import argparse
import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peerlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS_IN = "/opt/bragg-tools"
ENV = ["PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8"]

# init_protocol.h
SPAWN, STDIN, OUTPUT_CREDIT = 1, 3, 4
SPAWNED, SPAWN_FAILED, EXITED, ERROR, OUTPUT, READY = 0x81, 0x82, 0x83, 0x84, 0x85, 0x86
STDIN_CREDIT = 0x87
STDIN_NULL, STDOUT_NULL, STDERR_NULL, STREAM_STDIO = 1, 2, 4, 8
MAX_DATA = 64 * 1024
WINDOW = 256 * 1024  # kStdioWindowBytes: stdin sent ahead of StdinCredit, output of OutputCredit


def frame(typ, fid, payload):
    body = b"PBI" + bytes([1]) + struct.pack("<HHQ", typ, 0, fid) + payload
    return struct.pack("<I", len(body)) + body


def strlist(items):
    blob = b"".join(s.encode() + b"\0" for s in items)
    return struct.pack("<II", len(items), len(blob)) + blob


def spawn_frame(fid, argv, flags):
    cwd = b"/"
    return frame(SPAWN, fid, struct.pack("<I", flags | STREAM_STDIO) +
                 struct.pack("<I", len(cwd)) + cwd + strlist(argv) + strlist(ENV))


LIBC = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096


def mount(source, target, fstype, flags, data):
    """mount(2) itself: a `mount` command per mount would time a fork and exec of mount(8)."""
    if LIBC.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                  ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


CGROUP_V1 = "/sys/fs/cgroup"
CGROUP_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "pids", "freezer")


class Cgroup:
    """One cgroup v1 directory per controller, under this process's own cgroups (`parent`/`name`):
    pbox's per-sandbox limits (gvisor_runtime.cc, cgroup_v1.cc) without pbox."""

    def __init__(self, parent, name, cpu):
        own = {}
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(","):
                    own[c] = path
        self.dirs = []
        try:
            self._make(own, parent, name, cpu)
        except BaseException:
            self.remove()
            raise

    def _make(self, own, parent, name, cpu):
        for c in CGROUP_CONTROLLERS:
            base = f"{CGROUP_V1}/{c}"
            if c not in own or not os.path.isdir(base):
                raise RuntimeError(f"--cgroup needs the cgroup v1 {c} hierarchy at {base}")
            top = f"{base}{own[c].rstrip('/')}/{parent}"
            d = f"{top}/{name}"
            os.makedirs(d)
            self.dirs.append(d)
            if c == "cpuset":
                # A new v1 cpuset starts empty: the parent inherits its own parent's sets first.
                for f in ("cpuset.cpus", "cpuset.mems"):
                    if not _read(f"{top}/{f}"):
                        _write(f"{top}/{f}", _read(f"{os.path.dirname(top)}/{f}"))
                _write(f"{d}/cpuset.mems", _read(f"{top}/cpuset.mems"))
                _write(f"{d}/cpuset.cpus", str(cpu))
            elif c == "memory":
                _write(f"{d}/memory.limit_in_bytes", str(1 << 30))
            elif c == "pids":
                _write(f"{d}/pids.max", "512")

    def join(self):
        """For preexec_fn: moves the calling (single-threaded, forked) process in."""
        for d in self.dirs:
            _write(f"{d}/tasks", "0")

    def remove(self):
        for d in self.dirs:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # the sandbox's last tasks are still leaving
        for d in self.dirs:
            try:
                os.rmdir(os.path.dirname(d))
            except OSError:
                pass  # other sandboxes' cgroups are still in it


def _read(path):
    with open(path) as f:
        return f.read().strip()


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


class Sandbox:
    """One `runsc run` of its own bundle under `root`; owns its mounts, cgroup and runsc child."""

    def __init__(self, root, name, args):
        self.dir = os.path.join(root, name)
        self.mounts = []
        self.proc = None
        self.cgroup = None
        self.next_id = 1
        try:
            self._start(name, args)
        except BaseException:
            self.close()
            raise

    def _start(self, name, args):
        preamble = b""
        isolate = getattr(args, "isolate", "")
        if isolate:  # the program preamble (init_protocol.h): pbox's agent holds it in memory
            with open(isolate, "rb") as f:
                program = f.read()
            preamble = struct.pack("<I", len(program)) + program
        t = time.monotonic()
        os.makedirs(self.dir + "/layer")
        os.makedirs(self.dir + "/rootfs")
        self._mount("pbox", "/layer", "tmpfs", MS_NOSUID | MS_NODEV, "size=1g")
        os.makedirs(self.dir + "/layer/upper")
        os.makedirs(self.dir + "/layer/work")
        self._mount("overlay", "/rootfs", "overlay", MS_NOSUID | MS_NODEV,
                    f"lowerdir={args.skeleton},upperdir={self.dir}/layer/upper,"
                    f"workdir={self.dir}/layer/work")
        self._mount("/usr", "/rootfs/usr", "", MS_BIND, "")
        mount("", self.dir + "/rootfs/usr", "", MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID |
              MS_NODEV, "")
        # --isolate FILE: pbox-init puts commands in a PID namespace of their own and loads
        # this seccomp program, sent ahead of the frames on its stdin, as under pbox's gVisor
        # runtime (docs/pbox.md); it needs the two capabilities pbox's bundle gives it for that.
        config = {
            "ociVersion": "1.0.0",
            "process": {"terminal": False, "user": {"uid": 0, "gid": 0},
                        "args": ["/dev/pbox-init", "--stream"] +
                                (["--isolate"] if isolate else []),
                        "env": ENV[:1], "cwd": "/",
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
        if isolate:
            config["process"]["capabilities"] = {
                k: ["CAP_SYS_ADMIN", "CAP_SETPCAP"] for k in ("bounding", "effective", "permitted")}
        with open(self.dir + "/config.json", "w") as f:
            json.dump(config, f)
        # --pin: this sandbox's runsc, and the gofer and sentry it starts, on one CPU, as
        # pbox gives each sandbox one CPU of its set by default (round-robin here; pbox picks
        # the least loaded). The sentry sizes the sandbox's vCPUs from it, as under pbox.
        pin = None
        if args.pin_cpus:
            cpu = args.pin_cpus[args.pin_next % len(args.pin_cpus)]
            args.pin_next += 1
            if getattr(args, "cgroup", False):
                self.cgroup = Cgroup(f"bragg-runsc-peer-{os.getpid()}", name, cpu)
                pin = self.cgroup.join
            else:
                def pin():
                    os.sched_setaffinity(0, {cpu})
        t_run = time.monotonic()
        with open(self.dir + "/runsc.log", "w") as log:
            self.proc = subprocess.Popen(
                [args.runsc, "--root", self.dir + "/runsc-root", "--platform", args.platform,
                 "--network=none", "--file-access=shared", "--ignore-cgroups", "run",
                 "--bundle", self.dir, name],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, preexec_fn=pin)
        if isolate:
            self.proc.stdin.write(preamble)
            self.proc.stdin.flush()
        typ, _, _ = self.read()
        if typ != READY:
            raise RuntimeError(f"expected Ready from pbox-init, got {typ:#x}")
        now = time.monotonic()
        self.create_ms = (now - t) * 1000.0
        self.create_runsc_ms = (now - t_run) * 1000.0
        self.run(["true"])  # the first command, as pbox-bench runs one after each create
        self.create_exec_ms = (time.monotonic() - t) * 1000.0

    def _mount(self, source, sub, fstype, flags, data):
        mount(source, self.dir + sub, fstype, flags, data)
        self.mounts.append(self.dir + sub)

    def read(self):
        """The next frame: (type, id, payload)."""
        head = self.proc.stdout.read(4)
        if len(head) < 4:
            with open(self.dir + "/runsc.log") as f:
                raise RuntimeError("runsc ended the stream: " + f.read()[-1500:].strip())
        (n,) = struct.unpack("<I", head)
        body = self.proc.stdout.read(n)
        typ, _, fid = struct.unpack("<HHQ", body[4:16])
        return typ, fid, body[16:]

    def run(self, argv, stdin=None):
        """Runs argv to its exit; returns (wall ms, stdout bytes)."""
        fid = self.next_id
        self.next_id += 1
        flags = STDERR_NULL | (0 if stdin is not None else STDIN_NULL)
        t = time.monotonic()
        self.proc.stdin.write(spawn_frame(fid, argv, flags))
        # Stdin within the window pbox-init grants (it refuses a sender past it).
        sent, credit, eof_sent = 0, WINDOW, stdin is None

        def feed():
            nonlocal sent, credit, eof_sent
            while not eof_sent:
                if sent == len(stdin):
                    self.proc.stdin.write(frame(STDIN, fid, struct.pack("<I", 0)))
                    eof_sent = True
                    break
                n = min(MAX_DATA, credit, len(stdin) - sent)
                if n == 0:
                    break
                chunk = stdin[sent:sent + n]
                self.proc.stdin.write(frame(STDIN, fid, struct.pack("<I", n) + chunk))
                sent += n
                credit -= n
            self.proc.stdin.flush()

        feed()
        out = []
        while True:
            typ, got, payload = self.read()
            if got != fid:
                continue
            if typ == STDIN_CREDIT:
                credit += struct.unpack("<I", payload[:4])[0]
                feed()
            elif typ == OUTPUT:
                data = payload[5:]
                out.append(data)
                if data:  # reopen the stream's window
                    self.proc.stdin.write(frame(OUTPUT_CREDIT, fid,
                                                payload[:1] + struct.pack("<I", len(data))))
                    self.proc.stdin.flush()
            elif typ == EXITED:
                code, sig = struct.unpack("<ii", payload[:8])
                if code != 0:
                    raise RuntimeError(f"{argv}: exit {code}, signal {sig}")
                return (time.monotonic() - t) * 1000.0, b"".join(out)
            elif typ in (SPAWN_FAILED, ERROR):
                raise RuntimeError(f"{argv}: pbox-init refused or could not start it ({typ:#x})")

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()  # pbox-init exits at EOF, which ends the container
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for m in reversed(self.mounts):
            subprocess.call(["umount", "-l", m])
        if self.cgroup is not None:
            self.cgroup.remove()


def find_init(arg):
    for cand in (arg, os.environ.get("PBOX_INIT"), os.path.join(ROOT, "build/src/pbox/pbox-init")):
        if cand and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=10, help="live sandboxes")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tool-samples", type=int, default=4)
    ap.add_argument("--tools", default=os.path.join(ROOT, "bench/pbox/tools"))
    ap.add_argument("--json", default="")
    ap.add_argument("--init", default="", help="the static pbox-init binary")
    ap.add_argument("--runsc", default="runsc")
    ap.add_argument("--platform", default="ptrace")
    ap.add_argument("--isolate", default="", metavar="SECCOMP_FILE",
                    help="pbox-init --isolate with this seccomp program (pbox's gVisor runtime "
                         "writes one to <state-dir>/gvisor/seccomp.bpf)")
    ap.add_argument("--pin", action="store_true",
                    help="pin each sandbox to one CPU (round-robin), as pbox does by default")
    ap.add_argument("--cgroup", action="store_true",
                    help="with --pin: through a cgroup v1 set of pbox's kind per sandbox "
                         "(one-CPU cpuset, memory and pids limits) instead of sched_setaffinity")
    args = ap.parse_args()
    if args.cgroup and not args.pin:
        sys.exit("runsc_peer: --cgroup goes with --pin")
    args.pin_cpus = sorted(os.sched_getaffinity(0)) if args.pin else []
    if args.isolate and not os.path.isfile(args.isolate):
        sys.exit(f"runsc_peer: --isolate {args.isolate}: no such file")
    args.pin_next = 0
    if args.sandboxes <= 0 or args.rounds <= 0 or args.tool_samples < 0:
        sys.exit("runsc_peer: --sandboxes and --rounds must be positive")
    if os.geteuid() != 0:
        peerlib.skip("runsc peer mounts overlays and runs runsc as root: needs root")
    runsc = shutil.which(args.runsc) or shutil.which(args.runsc, path="/usr/sbin:/usr/bin")
    if runsc is None:
        peerlib.skip("runsc is not installed (Debian: apt-get install runsc)")
    args.runsc = runsc
    args.init = find_init(args.init)
    if args.init is None:
        peerlib.skip("pbox-init not found: build it (ninja pbox-init) or set $PBOX_INIT")

    work = tempfile.mkdtemp(prefix="bragg-runsc-peer-")
    args.skeleton = peerlib.make_skeleton(os.path.join(work, "skel"))
    boxes = []
    try:
        n = args.sandboxes
        for i in range(n):
            try:
                boxes.append(Sandbox(work, f"peer-{i}", args))
            except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                if i == 0:
                    peerlib.skip(f"runsc cannot start a sandbox here: {str(e).splitlines()[-1]}")
                raise
        create = [b.create_ms for b in boxes]
        create_runsc = [b.create_runsc_ms for b in boxes]
        create_exec = [b.create_exec_ms for b in boxes]
        print(f"runsc: {n} sandboxes, create p50 {peerlib.pct(create, 50):.1f} ms "
              f"(runsc run -> Ready {peerlib.pct(create_runsc, 50):.1f} ms)", file=sys.stderr)

        def exec_all(argv):
            return [b.run(argv)[0] for _ in range(args.rounds) for b in boxes]

        exec_true = exec_all(["true"])
        exec_python = exec_all(["python3", "-c", "pass"])
        print(f"runsc: exec true p50 {peerlib.pct(exec_true, 50):.1f} ms, python3 -c pass p50 "
              f"{peerlib.pct(exec_python, 50):.1f} ms", file=sys.stderr)

        want = os.urandom(peerlib.MIB)

        def round_trip(i):
            t0 = time.monotonic()
            boxes[i].run(["sh", "-c", "cat > /tmp/bench.bin"], stdin=want)
            _, back = boxes[i].run(["cat", "/tmp/bench.bin"])
            ms = (time.monotonic() - t0) * 1000.0
            if back != want:
                raise RuntimeError("downloaded bytes differ from uploaded ones")
            return ms

        rtt, rtt_conc, gbps = peerlib.round_trips(round_trip, n, args.rounds, "runsc")

        names, tool_ms = [], []
        if args.tool_samples > 0:
            tools = peerlib.load_tools(args.tools)
            names = [name for name, _ in tools]
            tool_ms = [[] for _ in tools]
            for b in boxes:  # into the rootfs on the host (gVisor sees it: --file-access=shared)
                shutil.copytree(args.tools, b.dir + "/rootfs" + TOOLS_IN)
            for k in range(args.tool_samples):
                for t, (name, _) in enumerate(tools):
                    b = boxes[(k * len(tools) + t) % n]
                    tool_ms[t].append(b.run(["python3", f"{TOOLS_IN}/{name}.py", str(k)])[0])
            for name, ms in zip(names, tool_ms):
                print(f"runsc: tool {name} p50 {peerlib.pct(ms, 50):.1f} ms", file=sys.stderr)

        version = subprocess.run([args.runsc, "--version"], capture_output=True,
                                 text=True).stdout.splitlines()[0]
        peerlib.write_result(
            args.json, "runsc-by-hand" + ("-pinned" if args.pin else "") +
            ("-isolated" if args.isolate else ""), n,
            {"create_ms": peerlib.summary(create), "create_runsc_ms": peerlib.summary(create_runsc),
             "create_exec_ms": peerlib.summary(create_exec),
             "exec_true_ms": peerlib.summary(exec_true),
             "exec_python_ms": peerlib.summary(exec_python), "rtt_1mib_ms": peerlib.summary(rtt),
             "rtt_1mib_concurrent_ms": peerlib.summary(rtt_conc)},
            gbps, peerlib.tools_json(names, tool_ms),
            [f"{version}, --platform={args.platform} --network=none --file-access=shared "
             f"--ignore-cgroups (no memory limit), {n} sandboxes, pbox-init --stream driven "
             "directly, /usr bound read-only; files travel as stdin/stdout of cat; create timed "
             "from the bundle's first step (mounts through mount(2), config.json) to Ready"
             + ("; pbox-init --isolate (commands in their own PID namespace)" if args.isolate
                else "")
             + (f"; each sandbox pinned to one of CPUs {args.pin_cpus} in turn "
                "(sched_setaffinity of runsc)" if args.pin else "; not pinned: every sandbox "
                "may use every CPU")],
            peer_of="gvisor")
    finally:
        for b in boxes:
            b.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
