#!/usr/bin/python3
"""Where a gVisor sandbox's create goes: a system-wide `perf record` (cpu-clock) around the
creates of each kind in turn, pbox's and runsc's by hand, and the CPU time of each part of
the stack per create, from the samples' processes.

    bench/pbox/gvisor_create_profile.py --build build [--sandboxes 15]
        [--kinds pbox1,pinned-isolate,pinned,pbox2,unpinned-isolate,unpinned] [--freq 2000]

Kinds as in gvisor_create_ab.py: pboxC (pboxd's gVisor runtime, C CPUs per sandbox, created
through the Python client), pinned / unpinned (runsc_peer.py's `runsc run` by hand, one CPU
per sandbox in turn or none), -isolate (pbox-init --isolate with the agent's seccomp program).
Each kind's sandboxes are created one after the other while perf records every CPU; the
sandboxes are destroyed after perf stops. Samples are assigned by process, from perf's fork
events:
  agent         pboxd (every thread) and its launcher child until it execs runsc
  runsc run     the `runsc run` process
  gofer         runsc's file server (a child of `runsc run` that starts no process)
  sentry        gVisor's kernel (`runsc boot`, the child of `runsc run` that starts stubs)
  stubs         the ptrace platform's stub processes, where sandboxed code runs and traps
  client        this script (the Python client, or the peer's driver writing frames)
Each is split into user and kernel (`[kernel.kallsyms]`) time. `idle` is what was left of
every CPU. A second perf session records every context switch with its kernel stack, for
the time runsc's processes spent off their CPU and why (an RCU grace period, a ptrace stop,
waiting for a peer, ...). Needs root, perf, runsc and a build.
"""

import argparse
import collections
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench/pbox"))
import gvisor_create_ab  # noqa: E402

PARTS = ["agent", "runsc run", "gofer", "sentry", "stubs", "client", "other"]
FORK = re.compile(r"PERF_RECORD_FORK\((\d+):\d+\):\((\d+):\d+\)")
COMM = re.compile(r"PERF_RECORD_COMM(?: exec)?: (.+) (\d+)/\d+")


def record(out, events):
    """Starts a system-wide perf record of `events` (perf arguments); returns the process
    (stop with SIGINT)."""
    proc = subprocess.Popen(["perf", "record", "-a", "-q", "-o", out] + events,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # perf opens its events before the measured work starts
    if proc.poll() is not None:
        sys.exit("gvisor_create_profile: perf record failed: " + proc.stderr.read().decode())
    return proc


SWITCH = re.compile(r"\s(\d+)\s+\[\d+\]\s+([\d.]+):\s+sched:sched_switch: prev_comm=(.*?) "
                    r"prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> next_comm=.*? "
                    r"next_pid=(\d+)")
# Why a thread of runsc's (runsc run, gofer, sentry, stubs) was off its CPU, from the kernel
# frames of its switch: the first rule whose frame is on the stack.
WAITS = [("RCU grace period", ("synchronize_rcu",)),
         ("ptrace stop (stubs, sentry)", ("ptrace_stop",)),
         ("page fault, mmap lock", ("lock_mm_and_find_vma", "rwsem_down")),
         ("pipe read", ("pipe_read",)),
         ("poll, epoll (a peer's answer)", ("do_sys_poll", "do_epoll_wait")),
         ("wait4 (a child)", ("do_wait",)),
         ("nanosleep", ("do_nanosleep",)),
         ("futex (Go runtime threads parked)", ("futex_wait",))]
OFF_PARTS = ["RCU grace period", "ptrace stop (stubs, sentry)", "page fault, mmap lock",
             "pipe read", "poll, epoll (a peer's answer)", "wait4 (a child)", "nanosleep",
             "futex (Go runtime threads parked)", "other"]


def off_cpu(data):
    """Thread-seconds off CPU (sleeping, in D state or ptrace-stopped) of runsc's processes
    (comm runsc or exe), by reason, and the count and seconds of RCU grace periods waited."""
    text = subprocess.run(["perf", "script", "-i", data], capture_output=True, text=True,
                          check=True).stdout
    out = collections.defaultdict(float)
    rcu = [0, 0.0]
    away = {}  # tid -> (time, reason)
    event = None
    for line in text.splitlines() + [""]:
        m = SWITCH.search(line)
        if m:
            event = [float(m.group(2)), m.group(3), int(m.group(4)), m.group(5),
                     int(m.group(6)), []]
            continue
        if event is not None and line.strip():
            event[5].append(line.split()[1].split("+")[0] if len(line.split()) > 1 else "")
            continue
        if event is None:
            continue
        t, prev_comm, prev, state, nxt, stack = event
        event = None
        if nxt in away:
            t0, why = away.pop(nxt)
            out[why] += t - t0
            if why == "RCU grace period":
                rcu[0] += 1
                rcu[1] += t - t0
        if prev_comm in ("runsc", "exe") and state[0] in "SDtT":
            why = next((name for name, frames in WAITS
                        if any(f.startswith(x) for f in stack for x in frames)), "other")
            away[prev] = (t, why)
    return out, rcu


def stop(proc):
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)


def classify(data, agent_pid, client_pid):
    """CPU seconds per (part, user|kernel), and idle seconds, from perf.data."""
    text = subprocess.run(["perf", "script", "-i", data, "--show-task-events",
                           "-F", "comm,pid,period,ip,dso"], capture_output=True, text=True,
                          check=True).stdout
    parent, comm, children = {}, {}, collections.defaultdict(set)
    samples = []
    for line in text.splitlines():
        m = FORK.search(line)
        if m:
            child, par = int(m.group(1)), int(m.group(2))
            if child != par:
                parent[child] = par
                children[par].add(child)
            continue
        m = COMM.search(line)
        if m:
            comm[int(m.group(2))] = m.group(1).strip()
            continue
        if "PERF_RECORD" in line:
            continue
        f = line.split()
        # comm may hold spaces; from the right: pid, period, ip, (dso).
        if len(f) < 5 or not f[-1].startswith("("):
            continue
        try:
            pid, period = int(f[-4]), int(f[-3])
        except ValueError:
            continue
        samples.append((" ".join(f[:-4]), pid, period, f[-1] == "([kernel.kallsyms])"))

    for name, pid, _, _ in samples:
        comm.setdefault(pid, name)

    def ancestors(pid):
        seen = []
        while pid in parent and len(seen) < 64:
            pid = parent[pid]
            seen.append(pid)
        return seen

    def comm_of(pid):
        """A process's name: its exec's, else a sample's, else its parent's (fork keeps it)."""
        for p in [pid] + ancestors(pid):
            if p in comm:
                return comm[p]
        return ""

    def part(name, pid):
        if pid == 0:
            return "idle"
        if pid == client_pid:
            return "client"
        if pid == agent_pid:
            return "agent"
        if name == "runsc":
            return "runsc run"
        up = ancestors(pid)
        if name == "exe":
            # runsc runs itself again (/proc/self/exe) as the gofer and as the sandbox; the
            # sandbox's children (and theirs) are the ptrace platform's stubs.
            if up and comm_of(up[0]) == "exe":
                return "stubs"
            return "sentry" if children.get(pid) else "gofer"
        if agent_pid in up[:1]:
            return "agent"  # pboxd's launcher child before its exec of runsc
        if client_pid in up[:1]:
            return "client"  # the peer's child before its exec of runsc
        return "other"

    cpu = collections.defaultdict(float)
    for name, pid, period, kernel in samples:
        p = part(name, pid)
        key = (p, "kernel" if kernel and p != "idle" else "user")
        cpu[key] += period / 1e9
    return cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--sandboxes", type=int, default=15, help="sandboxes of each kind")
    ap.add_argument("--kinds",
                    default="pbox1,pinned-isolate,pinned,pbox2,unpinned-isolate,unpinned")
    ap.add_argument("--freq", type=int, default=2000, help="perf samples per second per CPU")
    ap.add_argument("--rcu-expedited", choices=["0", "1"], default="",
                    help="set /sys/kernel/rcu_expedited for the run (restored after)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("gvisor_create_profile: needs root (pboxd, runsc, perf -a)")
    if shutil.which("perf") is None or shutil.which("runsc") is None:
        sys.exit("gvisor_create_profile: needs perf and runsc")
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    sys.path.insert(0, os.path.join(ROOT, "bench/peers"))
    import pbox  # noqa: E402
    import peerlib  # noqa: E402
    import runsc_peer  # noqa: E402

    kinds = [k for k in args.kinds.split(",") if k]
    rcu_path = "/sys/kernel/rcu_expedited"
    with open(rcu_path) as f:
        rcu_before = f.read().strip()
    tmp = tempfile.mkdtemp(prefix="gvisor-profile-")
    agent = None
    rows = []
    try:
        if args.rcu_expedited:
            with open(rcu_path, "w") as f:
                f.write(args.rcu_expedited)
        agent = gvisor_create_ab.start_agent(build, tmp + "/new", [])
        client = pbox.Client(f"unix://{tmp}/new/s.sock")
        client.create(runtime="gvisor").destroy()  # the agent's first-use costs, unmeasured

        class PeerArgs:
            pass
        base = PeerArgs()
        base.init = os.path.join(build, "src/pbox/pbox-init")
        base.runsc = shutil.which("runsc")
        base.platform = "ptrace"
        base.skeleton = peerlib.make_skeleton(tmp + "/skel")
        seccomp = tmp + "/new/state/gvisor/seccomp.bpf"
        ncpu = len(os.sched_getaffinity(0))
        for k in kinds:
            made, wall = [], []
            data = os.path.join(tmp, f"{k}.data")
            sched = os.path.join(tmp, f"{k}.sched.data")
            perf = record(data, ["-F", str(args.freq)])
            perf_sched = record(sched, ["-e", "sched:sched_switch", "-g"])
            t0 = time.monotonic()
            try:
                for i in range(args.sandboxes):
                    t = time.monotonic()
                    if k.startswith("pbox"):
                        made.append(client.create(cpus=int(k[4:]), runtime="gvisor"))
                        wall.append((time.monotonic() - t) * 1e3)
                    else:
                        a = PeerArgs()
                        a.__dict__.update(base.__dict__)
                        a.pin_cpus = sorted(os.sched_getaffinity(0)) if k.startswith(
                            "pinned") else []
                        a.pin_next = i
                        a.isolate = seccomp if "-isolate" in k else ""
                        a.cgroup = False
                        b = runsc_peer.Sandbox(tmp, f"{k}-{i}", a)
                        made.append(b)
                        wall.append(b.create_ms)
                span = time.monotonic() - t0
            finally:
                stop(perf)
                stop(perf_sched)
                for sb in made:
                    try:
                        sb.destroy() if k.startswith("pbox") else sb.close()
                    except Exception:  # noqa: BLE001 - the agent's exit destroys the rest
                        pass
            cpu = classify(data, agent.pid, os.getpid())
            off, rcu = off_cpu(sched)
            n = len(wall)
            row = {"kind": k, "n": n, "p50": statistics.median(wall),
                   "mean": statistics.fmean(wall), "span": span,
                   "cpu": {key: v * 1e3 / n for key, v in cpu.items()},
                   "off": {key: v * 1e3 / n for key, v in off.items()},
                   "rcu": (rcu[0] / n, rcu[1] * 1e3 / max(rcu[0], 1))}
            rows.append(row)
            print(f"{k}: {n} creates, p50 {row['p50']:.1f} ms (load {os.getloadavg()[0]:.2f})",
                  file=sys.stderr)
    finally:
        if args.rcu_expedited:
            with open(rcu_path, "w") as f:
                f.write(rcu_before)
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{args.sandboxes} creates per kind, perf record -a -F {args.freq} (cpu-clock), "
          f"{ncpu} CPUs, rcu_expedited {args.rcu_expedited or rcu_before}, "
          f"load {os.getloadavg()}")
    print("CPU ms per create, user + kernel; `busy` is every part but idle, `wall` the mean "
          "create time (busy over wall: how many CPUs it kept busy).")
    print("| kind | create p50 ms | wall mean ms | " +
          " | ".join(PARTS) + " | busy | busy / wall |")
    print("|---|---:|---:|" + "---:|" * (len(PARTS) + 2))
    for r in rows:
        c = r["cpu"]
        cells = []
        busy = 0.0
        for p in PARTS:
            u, kk = c.get((p, "user"), 0.0), c.get((p, "kernel"), 0.0)
            busy += u + kk
            cells.append(f"{u + kk:.1f} ({u:.1f} + {kk:.1f})")
        # The samples span the whole phase: per create that is wall time plus the gaps between
        # creates (the client's own bookkeeping), which the agent and client parts hold.
        print(f"| {r['kind']} | {r['p50']:.1f} | {r['mean']:.1f} | " + " | ".join(cells) +
              f" | {busy:.1f} | {busy / r['mean']:.2f} |")
    print()
    print("Off CPU: thread-ms per create that runsc's processes (runsc run, gofer, sentry, "
          "stubs) spent asleep, blocked or ptrace-stopped, by the kernel frame they waited in "
          "(perf record -e sched:sched_switch -g; threads wait at once, so these add up past "
          "the wall time). RCU: grace periods waited per create (runsc's membarrier "
          "registration at each of its starts, fd table growth) and their mean length.")
    print("| kind | " + " | ".join(OFF_PARTS) + " | RCU waits per create | mean RCU wait ms |")
    print("|---|" + "---:|" * (len(OFF_PARTS) + 2))
    for r in rows:
        print(f"| {r['kind']} | " + " | ".join(f"{r['off'].get(p, 0.0):.1f}" for p in OFF_PARTS)
              + f" | {r['rcu'][0]:.1f} | {r['rcu'][1]:.1f} |")


if __name__ == "__main__":
    main()
