#!/usr/bin/python3
"""pbox scale benchmark: N idle sandboxes live at once on one agent, then N concurrent execs.

    bench/pbox/scale.py --build build [--sandboxes 1000] [--create-concurrency 16]

Reports (JSON on stdout): how many sandboxes were created (and the first error if the target
was not reached), the agent's RSS and threads per sandbox, the sandboxes' own memory (their
cgroups' usage, as the agent reports it) per sandbox, the host's MemAvailable drop per sandbox,
a trivial exec's latency (p50/p99) with all of them idle, and the latency of N execs of `true`
started at once (one per sandbox). Needs root.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pct(values, q):
    s = sorted(values)
    return s[max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))]


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def proc_status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def ms(values):
    return {"p50_ms": round(1e3 * pct(values, 50), 2), "p99_ms": round(1e3 * pct(values, 99), 2),
            "max_ms": round(1e3 * max(values), 2), "n": len(values)}


async def bench(args, endpoint, agent_pid):
    import pbox
    import pbox.aio

    out = {"target": args.sandboxes, "load_average_start": os.getloadavg()}
    avail0 = mem_available()
    rss0 = proc_status(agent_pid, "VmRSS") * 1024
    threads0 = proc_status(agent_pid, "Threads")
    async with pbox.aio.Client(endpoint) as c:
        sandboxes, errors, create_lat = [], [], []
        sem = asyncio.Semaphore(args.create_concurrency)
        stop = asyncio.Event()

        async def make():
            async with sem:
                if stop.is_set():
                    return
                t0 = time.monotonic()
                try:
                    sb = await c.create(memory=args.memory, disk=args.disk)
                    sandboxes.append(sb)
                    create_lat.append(time.monotonic() - t0)
                except pbox.PboxError as e:
                    errors.append(str(e))
                    stop.set()

        t0 = time.monotonic()
        await asyncio.gather(*(make() for _ in range(args.sandboxes)))
        out["created"] = len(sandboxes)
        out["create_seconds"] = round(time.monotonic() - t0, 1)
        out["create"] = ms(create_lat)
        out["first_error"] = errors[0] if errors else None
        n = len(sandboxes)
        await asyncio.sleep(2)  # let the new sandboxes settle (page cache, lazy allocations)
        rss1 = proc_status(agent_pid, "VmRSS") * 1024
        infos = await c.list()
        usage = sum(i.memory_usage_bytes for i in infos)
        out["agent_rss_before_mib"] = round(rss0 / 2**20, 1)
        out["agent_rss_after_mib"] = round(rss1 / 2**20, 1)
        out["agent_rss_per_sandbox_kib"] = round((rss1 - rss0) / n / 1024, 1)
        out["agent_threads_per_sandbox"] = round(
            (proc_status(agent_pid, "Threads") - threads0) / n, 2)
        out["agent_fds"] = len(os.listdir(f"/proc/{agent_pid}/fd"))
        out["cgroup_usage_per_sandbox_mib"] = round(usage / n / 2**20, 2)
        out["host_memavailable_drop_per_sandbox_mib"] = round(
            (avail0 - mem_available()) / n / 2**20, 2)

        # A trivial exec with all of them idle, one at a time.
        probe = sandboxes[0]
        seq = []
        for _ in range(args.samples):
            t1 = time.monotonic()
            r = await probe.run(["true"], timeout=120)
            assert r.ok, r
            seq.append(time.monotonic() - t1)
        out["exec_true_idle_load"] = ms(seq)

        # N execs of `true` at once, one per sandbox.
        async def one(sb):
            t1 = time.monotonic()
            r = await sb.run(["true"], timeout=600)
            return time.monotonic() - t1, r.ok

        t0 = time.monotonic()
        res = await asyncio.gather(*(one(sb) for sb in sandboxes), return_exceptions=True)
        lat = [x[0] for x in res if isinstance(x, tuple) and x[1]]
        out["concurrent_execs"] = ms(lat) if lat else {}
        out["concurrent_execs_failed"] = len(res) - len(lat)
        out["concurrent_execs_wall_s"] = round(time.monotonic() - t0, 2)
        out["peak_agent_rss_mib"] = round(proc_status(agent_pid, "VmHWM") / 1024, 1)

        t0 = time.monotonic()
        await asyncio.gather(*(sb.destroy() for sb in sandboxes), return_exceptions=True)
        out["destroy_all_seconds"] = round(time.monotonic() - t0, 1)
        out["live_after_destroy"] = (await c.info()).live_sandboxes
    out["load_average_end"] = os.getloadavg()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--create-concurrency", type=int, default=16)
    ap.add_argument("--memory", default="256M", help="memory limit of each sandbox")
    ap.add_argument("--disk", default="64M", help="writable layer of each sandbox")
    ap.add_argument("--samples", type=int, default=200)
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    tmp = tempfile.mkdtemp(prefix="pbx-scale-", dir="/tmp")
    sock, ready = os.path.join(tmp, "pbox.sock"), os.path.join(tmp, "ready.json")
    log = open(os.path.join(tmp, "pboxd.log"), "wb")
    agent = subprocess.Popen([os.path.join(build, "src/pbox/pboxd"), "--listen", "unix://" + sock,
                              "--state-dir", os.path.join(tmp, "state"), "--ready-file", ready,
                              "--max-sandboxes", str(args.sandboxes + 8), "--log-level", "warn"],
                             stdout=log, stderr=subprocess.STDOUT)
    try:
        while not os.path.exists(ready):
            if agent.poll() is not None:
                sys.exit("pboxd exited early")
            time.sleep(0.05)
        out = asyncio.run(bench(args, "unix://" + sock, agent.pid))
        print(json.dumps(out, indent=1))
    finally:
        agent.terminate()
        agent.wait(120)
        log.close()
        subprocess.run(["rm", "-rf", tmp])


if __name__ == "__main__":
    main()
