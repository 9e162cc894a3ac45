#!/usr/bin/python3
"""1 MiB upload + download round trip from the Python clients: the gRPC streams against the
agent's data channel (docs/pbox.md "Data channel"), interleaved in the same run.

Each round writes SIZE random bytes into one sandbox and reads them back, once per path
(blocking client; with --aio also the asyncio client), the paths alternating so that load
changes hit both alike. Prints p50/p90/p99 per path and the machine's load average; --json
writes them too.

    sudo /usr/bin/python3 bench/pbox/python_rtt.py --build build --rounds 300

Starts its own pboxd (root) unless --endpoint names a running one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[2]


def percentile(xs: List[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def start_agent(build: Path, root: Path) -> subprocess.Popen:
    ready = root / "ready.json"
    proc = subprocess.Popen(
        [str(build / "src/pbox/pboxd"), "--listen", f"unix://{root}/pbox.sock", "--state-dir",
         str(root / "state"), "--ready-file", str(ready), "--log-level", "warn"],
        stdout=subprocess.DEVNULL, stderr=open(root / "pboxd.log", "wb"))
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"pboxd did not start: {(root / 'pboxd.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=str(REPO / "build"), help="CMake build directory")
    ap.add_argument("--endpoint", help="a running agent (default: start one)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--aio", action="store_true", help="also time the asyncio client")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    build = Path(args.build).resolve()
    sys.path.insert(0, str(build / "python"))
    import pbox
    import pbox.aio

    root = None
    proc = None
    endpoint = args.endpoint
    if endpoint is None:
        root = Path(tempfile.mkdtemp(prefix="pbx-rtt-", dir="/tmp"))
        proc = start_agent(build, root)
        endpoint = f"unix://{root}/pbox.sock"
    load_before = os.getloadavg()
    times: Dict[str, List[float]] = {"grpc": [], "data": []}
    if args.aio:
        times.update({"aio grpc": [], "aio data": []})
    try:
        with pbox.Client(endpoint) as dc, pbox.Client(endpoint, data_channel=False) as gc, \
                dc.session(client_name="python-rtt") as s:
            sb = s.create(memory="512M", disk="256M")
            via = {"data": sb, "grpc": gc.get(sb.id)}
            payload = os.urandom(args.size)

            def rtt(name: str) -> float:
                t0 = time.perf_counter()
                via[name].write_file("/tmp/rtt", payload)
                back = via[name].read_file("/tmp/rtt")
                dt = time.perf_counter() - t0
                assert len(back) == len(payload)
                return dt

            async def aio_rounds(n: int, record: bool) -> None:
                async with pbox.aio.Client(endpoint) as adc, \
                        pbox.aio.Client(endpoint, data_channel=False) as agc:
                    avia = {"aio data": await adc.get(sb.id), "aio grpc": await agc.get(sb.id)}
                    for i in range(n):
                        for name in (("aio data", "aio grpc") if i % 2 else
                                     ("aio grpc", "aio data")):
                            t0 = time.perf_counter()
                            await avia[name].write_file("/tmp/rtt", payload)
                            back = await avia[name].read_file("/tmp/rtt")
                            dt = time.perf_counter() - t0
                            assert len(back) == len(payload)
                            if record and i >= args.warmup:
                                times[name].append(dt)

            for i in range(args.warmup + args.rounds):
                for name in (("data", "grpc") if i % 2 else ("grpc", "data")):
                    dt = rtt(name)
                    if i >= args.warmup:
                        times[name].append(dt)
            assert not dc._data.off, "the data channel was not used"
            if args.aio:
                asyncio.run(aio_rounds(args.warmup + args.rounds, True))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()
    out = {"size": args.size, "rounds": args.rounds, "load_before": load_before,
           "load_after": load_after, "paths": {}}
    print(f"{args.size} B upload + download round trip, {args.rounds} rounds per path, "
          f"load {load_before[0]:.2f} -> {load_after[0]:.2f} (1-min average)")
    for name, xs in times.items():
        r = {"p50_ms": percentile(xs, 0.5) * 1e3, "p90_ms": percentile(xs, 0.9) * 1e3,
             "p99_ms": percentile(xs, 0.99) * 1e3}
        out["paths"][name] = r
        print(f"  {name:9s} p50 {r['p50_ms']:7.2f} ms  p90 {r['p90_ms']:7.2f} ms  "
              f"p99 {r['p99_ms']:7.2f} ms")
    for prefix in ("", "aio "):
        g, d = out["paths"].get(prefix + "grpc"), out["paths"].get(prefix + "data")
        if g and d:
            print(f"  {prefix}gRPC / data channel p50: {g['p50_ms'] / d['p50_ms']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
