#!/usr/bin/python3
"""Benchmark peer: podman with runc, the standard container workflow, measured the way
pbox-bench measures pbox (same metrics, same tool scripts, same JSON; see peerlib.py).

    bench/peers/podman_peer.py --sandboxes 10 --rounds 1 --tool-samples 5 --json OUT

- create: `podman run -d` of a container that sleeps, until the command returns (the
  container is running and accepts `podman exec`);
- create_exec: create, then `podman exec CID true` to its exit (the first command);
- exec: `podman exec CID true`, `podman exec CID python3 -c pass`;
- 1 MiB round trip: `podman cp FILE CID:/tmp/bench.bin`, then `podman cp CID:/tmp/bench.bin
  OUT`, bytes checked; one container at a time, then all at once (aggregate throughput);
- tools: `podman exec CID python3 /opt/bragg-tools/NAME.py SEED`, the scripts copied in once
  with `podman cp`.

No registry is needed: the image is `podman import` of a small skeleton (merged-/usr links, a
few /etc files, like pbox's "host" image) and every container bind-mounts the host's /usr
read-only, so it runs the host's python3 and numpy, as pbox's sandboxes do. Everything podman
writes lives in a private directory (its own containers.conf via CONTAINERS_CONF, storage and
run roots), removed at the end, so the host's podman setup is neither needed nor touched.
The private containers.conf sets what this kind of host needs: `runtime = "runc"` (crun
refuses hybrid cgroup hierarchies) and `default_ulimits = []` under [containers] (the packaged
default asks for RLIMIT_NOFILE values the host may not grant). Exit status 3 (skip) with a
note when podman or runc is missing or a container cannot start.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peerlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE = "localhost/bragg-bench-host:latest"
TOOLS_IN = "/opt/bragg-tools"
CONF = """# Written by bench/peers/podman_peer.py for its private podman store.
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
class Podman:
    def __init__(self, work):
        self.work = work
        self.env = dict(os.environ, CONTAINERS_CONF=os.path.join(work, "containers.conf"))
        self.base = ["podman", "--root", os.path.join(work, "storage"), "--runroot",
                     os.path.join(work, "run"), "--storage-driver", "overlay",
                     "--runtime", shutil.which("runc") or "runc", "--cgroup-manager", "cgroupfs",
                     "--events-backend", "file"]

    def __call__(self, *args, check=True):
        return peerlib.timed(self.base + list(args), check=check, env=self.env)


def build_skeleton(work):
    skel = peerlib.make_skeleton(os.path.join(work, "skel"))
    tar = os.path.join(work, "skel.tar")
    with tarfile.open(tar, "w") as t:
        t.add(skel, arcname=".")
    return tar


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sandboxes", type=int, default=10, help="live containers")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tool-samples", type=int, default=5)
    ap.add_argument("--tools", default=os.path.join(ROOT, "bench/pbox/tools"))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.sandboxes <= 0 or args.rounds <= 0 or args.tool_samples < 0:
        sys.exit("podman_peer: --sandboxes and --rounds must be positive")
    if not shutil.which("podman"):
        peerlib.skip("podman is not installed (Debian: apt-get install podman runc)")
    if not shutil.which("runc"):
        peerlib.skip("runc is not installed (Debian: apt-get install runc)")
    if os.geteuid() != 0:
        peerlib.skip("podman peer runs rootful podman: needs root")

    work = tempfile.mkdtemp(prefix="bragg-podman-peer-")
    with open(os.path.join(work, "containers.conf"), "w") as f:
        f.write(CONF)
    podman = Podman(work)
    ids = []
    try:
        _, proc = podman("import", build_skeleton(work), IMAGE)
        run_args = ["run", "-d", "--network", "none", "--memory", "256m", "-v", "/usr:/usr:ro",
                    IMAGE, "/usr/bin/sleep", "infinity"]
        n = args.sandboxes
        create, create_exec = [], []
        for i in range(n):
            ms, proc = podman(*run_args, check=False)
            if proc.returncode != 0:
                # The first one proves the setup (runc, cgroups, ulimits); a later failure is
                # a failure of the run.
                err = proc.stderr.decode(errors="replace").strip().splitlines()
                if i == 0:
                    peerlib.skip("podman cannot start a container here: " + (err or [""])[-1])
                raise RuntimeError(f"podman run: {(err or [''])[-1]}")
            ids.append(proc.stdout.decode().strip())
            create.append(ms)
            # The first command, as pbox-bench runs one after each create.
            create_exec.append(ms + podman("exec", ids[-1], "true")[0])
        print(f"podman: {n} containers, create p50 {peerlib.pct(create, 50):.1f} ms",
              file=sys.stderr)

        def exec_all(argv):
            out = []
            for _ in range(args.rounds):
                for cid in ids:
                    out.append(podman("exec", cid, *argv)[0])
            return out

        exec_true = exec_all(["true"])
        exec_python = exec_all(["python3", "-c", "pass"])
        print(f"podman: exec true p50 {peerlib.pct(exec_true, 50):.1f} ms, python3 -c pass p50 "
              f"{peerlib.pct(exec_python, 50):.1f} ms", file=sys.stderr)

        payload = os.path.join(work, "payload.bin")
        with open(payload, "wb") as f:
            f.write(os.urandom(peerlib.MIB))
        with open(payload, "rb") as f:
            want = f.read()

        def round_trip(i):
            back = os.path.join(work, f"back-{i}.bin")
            t0 = time.monotonic()
            podman("cp", payload, f"{ids[i]}:/tmp/bench.bin")
            podman("cp", f"{ids[i]}:/tmp/bench.bin", back)
            ms = (time.monotonic() - t0) * 1000.0
            with open(back, "rb") as f:
                if f.read() != want:
                    raise RuntimeError("podman cp: downloaded bytes differ from uploaded ones")
            os.unlink(back)
            return ms

        rtt, rtt_conc, gbps = peerlib.round_trips(round_trip, n, args.rounds, "podman")

        names, tool_ms = [], []
        if args.tool_samples > 0:
            tools = peerlib.load_tools(args.tools)
            names = [name for name, _ in tools]
            tool_ms = [[] for _ in tools]
            used = sorted({(k * len(tools) + t) % n for k in range(args.tool_samples)
                           for t in range(len(tools))})
            for i in used:  # the directory, once per container that runs a tool
                podman("cp", args.tools, f"{ids[i]}:{TOOLS_IN}")
            for k in range(args.tool_samples):
                for t, (name, _) in enumerate(tools):
                    cid = ids[(k * len(tools) + t) % n]
                    tool_ms[t].append(
                        podman("exec", cid, "python3", f"{TOOLS_IN}/{name}.py", str(k))[0])
            for name, ms in zip(names, tool_ms):
                print(f"podman: tool {name} p50 {peerlib.pct(ms, 50):.1f} ms", file=sys.stderr)

        version = subprocess.run(["podman", "--version"], capture_output=True,
                                 text=True).stdout.strip()
        runc = subprocess.run(["runc", "--version"], capture_output=True,
                              text=True).stdout.splitlines()[0]
        peerlib.write_result(
            args.json, "podman-runc", n,
            {"create_ms": peerlib.summary(create), "create_exec_ms": peerlib.summary(create_exec),
             "exec_true_ms": peerlib.summary(exec_true),
             "exec_python_ms": peerlib.summary(exec_python), "rtt_1mib_ms": peerlib.summary(rtt),
             "rtt_1mib_concurrent_ms": peerlib.summary(rtt_conc)},
            gbps, peerlib.tools_json(names, tool_ms),
            [f"{version}, {runc}, {n} containers, --network none, --memory 256m, "
             "/usr bind-mounted read-only"])
    finally:
        if ids:
            podman("rm", "-f", "-t", "0", *ids, check=False)
        podman("system", "reset", "-f", check=False)
        # The overlay driver's own mount of its directory may outlive the reset.
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[1].startswith(work + "/")]
        for m in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", m], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
