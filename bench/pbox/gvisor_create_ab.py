#!/usr/bin/python3
"""gVisor create and exec, pbox against runsc by hand, in turn: one pboxd (--runtime gvisor)
and runsc_peer.py's sandboxes, created one of each kind after the other, N rounds, so that
load drifting over the run falls on every kind alike (bench/pbox/run.py runs each system
after the other instead). Then every sandbox runs `true` and `python3 -c pass` twice, in
turn. Needs root, runsc and a build.

    bench/pbox/gvisor_create_ab.py --build build --sandboxes 10 \\
        [--kinds pbox1,old1,pinned,pinned-isolate,pbox2,unpinned]
        [--old-init OLD/pbox-init | --old-build OLD]

Kinds: pboxC (C CPUs per pbox sandbox), oldC (the same, from a second pboxd given
--init-path OLD_INIT, or the pboxd and pbox-init of another build, --old-build), pinned /
unpinned (runsc by hand, one CPU per sandbox in turn or none), -isolate after either (pbox-init --isolate with the agent's seccomp program, as
pbox's gVisor runtime runs it), and -cgroup after pinned[-isolate] (placed in a cgroup v1 set
of pbox's kind, runsc_peer.py --cgroup, instead of sched_setaffinity). Create is timed until the CreateSandbox RPC returns (pbox,
Python client) or pbox-init's Ready frame (runsc); exec until the command's exit.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_agent(build, tmp, extra, pboxd=None):
    """Starts a gVisor pboxd (the build's, or `pboxd`) on <tmp>/s.sock; returns it once it
    serves."""
    os.makedirs(tmp)
    proc = subprocess.Popen([pboxd or os.path.join(build, "src/pbox/pboxd"), "--listen",
                             f"unix://{tmp}/s.sock", "--state-dir", tmp + "/state",
                             "--ready-file", tmp + "/ready", "--log-level", "warn",
                             "--runtime", "gvisor", "--max-sandboxes", "400"] + extra)
    for _ in range(600):
        if os.path.exists(tmp + "/ready"):
            return proc
        if proc.poll() is not None:
            sys.exit(f"{os.path.basename(sys.argv[0])}: pboxd exited early")
        time.sleep(0.05)
    proc.kill()
    sys.exit(f"{os.path.basename(sys.argv[0])}: pboxd did not become ready")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--sandboxes", type=int, default=10, help="sandboxes of each kind")
    ap.add_argument("--kinds", default="pbox1,pinned,pinned-isolate,pbox2,unpinned")
    ap.add_argument("--old-init", default="", help="pbox-init of another build, for oldC")
    ap.add_argument("--old-build", default="", help="another build directory, for oldC")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    sys.path.insert(0, os.path.join(ROOT, "bench/peers"))
    import pbox  # noqa: E402
    import peerlib  # noqa: E402
    import runsc_peer  # noqa: E402

    kinds = [k for k in args.kinds.split(",") if k]
    if any(k.startswith("old") for k in kinds) and not (args.old_init or args.old_build):
        sys.exit("gvisor_create_ab: old kinds need --old-init or --old-build")
    tmp = tempfile.mkdtemp(prefix="gvisor-ab-")
    agents, boxes, sandboxes = [], [], []
    try:
        agents.append(start_agent(build, tmp + "/new", []))
        client = {"pbox": pbox.Client(f"unix://{tmp}/new/s.sock")}
        if args.old_init or args.old_build:
            old_build = os.path.abspath(args.old_build) if args.old_build else build
            old_init = (os.path.abspath(args.old_init) if args.old_init
                        else os.path.join(old_build, "src/pbox/pbox-init"))
            agents.append(start_agent(old_build, tmp + "/old", ["--init-path", old_init]))
            client["old"] = pbox.Client(f"unix://{tmp}/old/s.sock")

        class PeerArgs:
            pass
        peer = PeerArgs()
        peer.init = os.path.join(build, "src/pbox/pbox-init")
        peer.runsc = shutil.which("runsc") or "/usr/bin/runsc"
        peer.platform = "ptrace"
        peer.skeleton = peerlib.make_skeleton(tmp + "/skel")
        peer.pin_next = 0
        seccomp = tmp + "/new/state/gvisor/seccomp.bpf"

        def peer_args(kind):
            a = PeerArgs()
            a.__dict__.update(peer.__dict__)
            a.pin_cpus = sorted(os.sched_getaffinity(0)) if kind.startswith("pinned") else []
            a.isolate = seccomp if "-isolate" in kind else ""
            a.cgroup = kind.endswith("-cgroup")
            return a

        made = {k: [] for k in kinds}
        create = {k: [] for k in kinds}
        for i in range(args.sandboxes):
            for k in kinds:
                if k.startswith("pbox") or k.startswith("old"):
                    t = time.monotonic()
                    sb = client[k[:-1] if k[-1].isdigit() else k].create(
                        cpus=int(k[-1]), runtime="gvisor")
                    create[k].append((time.monotonic() - t) * 1e3)
                    sandboxes.append(sb)
                    made[k].append(sb.run)
                else:
                    a = peer_args(k)
                    a.pin_next = i
                    b = runsc_peer.Sandbox(tmp, f"{k}-{i}", a)
                    boxes.append(b)
                    create[k].append(b.create_ms)
                    made[k].append(b.run)
        execs = {k: ([], []) for k in kinds}
        for _ in range(2):
            for i in range(args.sandboxes):
                for k in kinds:
                    for j, argv in enumerate((["true"], ["python3", "-c", "pass"])):
                        t = time.monotonic()
                        made[k][i](argv)
                        execs[k][j].append((time.monotonic() - t) * 1e3)
        print(f"{args.sandboxes} of each kind, load {os.getloadavg()}")
        def pct(values, q):
            v = sorted(values)
            return v[min(len(v) - 1, int(q / 100 * len(v)))]

        print("| kind | create p50 ms | create min | exec `true` p50 ms | exec `true` p10 / p90 | "
              "exec `python3 -c pass` p50 ms |\n|---|---:|---:|---:|---:|---:|")
        for k in kinds:
            print(f"| {k} | {statistics.median(create[k]):.1f} | {min(create[k]):.1f} | "
                  f"{statistics.median(execs[k][0]):.1f} | {pct(execs[k][0], 10):.1f} / "
                  f"{pct(execs[k][0], 90):.1f} | {statistics.median(execs[k][1]):.1f} |")
    finally:
        for b in boxes:
            b.close()
        for sb in sandboxes:
            try:
                sb.destroy()
            except Exception:  # noqa: BLE001 - the agent's exit destroys what is left
                pass
        for a in agents:
            a.terminate()
            a.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
