#!/usr/bin/python3
"""pbox overload benchmark: a hostile client keeps 10x the admission limit of creates in flight
(in a process of its own) while a bystander client times a trivial exec in its sandbox.

    bench/pbox/overload.py --build build [--limit 10] [--seconds 20] [--samples 300]
        [--pboxd PATH] [--agent-arg=--client-refusals-per-second=0 ...]

Prints JSON: the refusals' count and latency (p50/p99, RESOURCE_EXHAUSTED), the bystander's
exec `true` latency unloaded and loaded (p50/p99) with their ratio, the CPU seconds the agent
and the hostile process used while loaded, and the load average. Needs root.

The hostile client's sandboxes are created and left idle: they use no CPU, so what the
bystander competes with is the agent's work on the hostile calls and the hostile process itself
(which runs on the same two CPUs: its CPU time is printed so that the two can be told apart).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(values, q):
    s = sorted(values)
    return s[max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))]


def hammer(endpoint, threads, seconds):
    import pbox

    client = pbox.Client(endpoint)
    refusals, held, other = [], [], []
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop():
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                sb = client.create()
                with lock:
                    held.append(sb)
            except pbox.ResourceExhausted:
                with lock:
                    refusals.append(time.monotonic() - t0)
            except pbox.PboxError as e:
                with lock:
                    other.append(str(e))

    ts = [threading.Thread(target=loop) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for sb in held:
        sb.destroy()
    json.dump({"refusals": len(refusals), "created": len(held), "other_errors": other[:5],
               "refusal_p50_ms": 1e3 * pct(refusals, 50) if refusals else None,
               "refusal_p99_ms": 1e3 * pct(refusals, 99) if refusals else None,
               "refusal_max_ms": 1e3 * max(refusals) if refusals else None}, sys.stdout)


def cpu_seconds(pid):
    """utime + stime of a process (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def time_runs(sb, n):
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        r = sb.run(["true"], timeout=60)
        assert r.ok, r
        out.append(time.monotonic() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--pboxd", help="agent binary (default: BUILD/src/pbox/pboxd)")
    ap.add_argument("--agent-arg", action="append", default=[],
                    help="extra pboxd flag, e.g. --agent-arg=--client-refusals-per-second=0")
    ap.add_argument("--hammer", nargs=3, metavar=("ENDPOINT", "THREADS", "SECONDS"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    if args.hammer:
        hammer(args.hammer[0], int(args.hammer[1]), float(args.hammer[2]))
        return
    import pbox

    tmp = tempfile.mkdtemp(prefix="pbx-ovl-", dir="/tmp")
    sock, ready = os.path.join(tmp, "pbox.sock"), os.path.join(tmp, "ready.json")
    pboxd = os.path.abspath(args.pboxd) if args.pboxd else os.path.join(build, "src/pbox/pboxd")
    agent = subprocess.Popen([pboxd, "--listen", "unix://" + sock,
                              "--state-dir", os.path.join(tmp, "state"), "--ready-file", ready,
                              "--max-sandboxes", str(args.limit), "--log-level", "warn"] +
                             args.agent_arg)
    try:
        while not os.path.exists(ready):
            if agent.poll() is not None:
                sys.exit("pboxd exited early")
            time.sleep(0.05)
        endpoint = "unix://" + sock
        with pbox.Client(endpoint) as c:
            sb = c.create()
            time_runs(sb, 20)  # warm-up
            load_before = os.getloadavg()
            unloaded = time_runs(sb, args.samples)
            env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
            ham = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--build", build,
                                    "--hammer", endpoint, str(10 * args.limit),
                                    str(args.seconds)], stdout=subprocess.PIPE, env=env)
            time.sleep(1.0)  # let the hammer fill the limit
            agent_cpu0, ham_cpu0, t_loaded = cpu_seconds(agent.pid), cpu_seconds(ham.pid), \
                time.monotonic()
            loaded = []
            ham_cpu1 = ham_cpu0
            while ham.poll() is None and len(loaded) < 20 * args.samples:
                loaded += time_runs(sb, 1)
                try:
                    ham_cpu1 = cpu_seconds(ham.pid)
                except (OSError, IndexError):
                    pass
            agent_cpu1, t_end = cpu_seconds(agent.pid), time.monotonic()
            hammer_out = json.loads(ham.communicate()[0])
            sb.destroy()
        result = {
            "limit": args.limit, "hostile_threads": 10 * args.limit, "seconds": args.seconds,
            "hostile": hammer_out,
            "bystander_unloaded_p50_ms": 1e3 * pct(unloaded, 50),
            "bystander_unloaded_p99_ms": 1e3 * pct(unloaded, 99),
            "bystander_loaded_p50_ms": 1e3 * pct(loaded, 50),
            "bystander_loaded_p99_ms": 1e3 * pct(loaded, 99),
            "bystander_loaded_samples": len(loaded),
            "p50_ratio": pct(loaded, 50) / pct(unloaded, 50),
            "p99_ratio": pct(loaded, 99) / pct(unloaded, 99),
            "agent_cpu_share_loaded": (agent_cpu1 - agent_cpu0) / (t_end - t_loaded),
            "hostile_process_cpu_share_loaded": (ham_cpu1 - ham_cpu0) / (t_end - t_loaded),
            "hostile_calls_per_second": (hammer_out["refusals"] + hammer_out["created"]) /
                                        args.seconds,
            "load_average_before": load_before,
            "load_average": os.getloadavg(),
        }
        print(json.dumps(result, indent=1))
    finally:
        agent.terminate()
        agent.wait(30)
        subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()
