#!/usr/bin/python3
"""make demo: Bragg end to end on this machine, through its Python clients.

Part 1: starts pboxd on a temp socket (binaries from --build), opens a session, creates 100
sandboxes at once, and in each: uploads a 1 MiB numpy array of a diffraction-like signal, runs
an FFT + peak-finding analysis with numpy inside the sandbox, downloads its JSON result and
checks it against the same computation done here. Prints progress, then p50/p99 latencies and
throughput.

Part 2 (scripts/demo_rl.py, --skip-rl to leave it out): bragg-rl learns a scientific tool task,
the first X-ray diffraction peak (examples/xrd): a small Qwen3-MoE warm-started on a noisy
demonstrator, then GRPO over multi-turn rollouts through bragg-gateway and two bragg-engine
workers, tools in pbox sandboxes, asynchronous and synchronous runs side by side, plots and a
summary (--rl-quick: shorter runs, for ctest).

Part 3 (scripts/demo_rollout.py, with --rollout-step): one RL rollout step on a real model: a tiny Qwen3-MoE's trainer checkpoints (Megatron torch_dist, two steps) converted by
bragg-reshard; multi-turn rollouts through bragg-gateway (sticky) over two bragg-engine workers
serving step 0, their tool calls in pbox sandboxes on the same agent, step 1 loaded by the whole
fleet in place mid-rollout, delta router replay of the model's real routing, and the
trajectories packed for training by bragg_pack.

Destroys everything, stops the agent. Exits 0 only if every check held.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

N_SANDBOXES = 100
SAMPLES = 131072  # float64: 1 MiB

# Runs inside each sandbox and here, on the same input.
ANALYSIS = r'''
import json, sys
import numpy as np

def analyze(x):
    spectrum = np.abs(np.fft.rfft(x - x.mean()))
    top = np.argsort(spectrum)[::-1][:5]
    thr = x.mean() + 3 * x.std()
    inner = x[1:-1]
    peaks = np.nonzero((inner > x[:-2]) & (inner >= x[2:]) & (inner > thr))[0] + 1
    return {
        "fft_top_bins": sorted(int(i) for i in top),
        "fft_top_power": float(spectrum[top].sum()),
        "peaks": [int(p) for p in peaks],
        "mean": float(x.mean()),
        "std": float(x.std()),
    }

if __name__ == "__main__":
    x = np.load(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(analyze(x), f)
'''


def make_signal(seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(SAMPLES, dtype=np.float64)
    x = np.zeros(SAMPLES)
    for f in rng.choice(np.arange(50, 5000), size=3, replace=False):
        x += rng.uniform(0.2, 0.5) * np.sin(2 * np.pi * f * t / SAMPLES)
    for center in rng.choice(np.arange(1000, SAMPLES - 1000), size=6, replace=False):
        width = rng.uniform(3, 12)
        x += rng.uniform(4, 8) * np.exp(-0.5 * ((t - center) / width) ** 2)  # Bragg peaks
    x += rng.normal(0, 0.05, SAMPLES)
    return x


def same(a: Dict, b: Dict) -> bool:
    if a["fft_top_bins"] != b["fft_top_bins"] or a["peaks"] != b["peaks"]:
        return False
    return all(abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(b[k]))
               for k in ("fft_top_power", "mean", "std"))


def pct(values: List[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def fail(msg: str) -> None:
    print(f"demo: FAILED: {msg}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default="build", help="CMake build directory")
    ap.add_argument("--sandboxes", type=int, default=N_SANDBOXES)
    ap.add_argument("--workers", type=int, default=16, help="client threads")
    ap.add_argument("--skip-rl", action="store_true", help="leave out part 2 (bragg-rl)")
    ap.add_argument("--rl-quick", action="store_true",
                    help="part 2 with 2-minute runs (ctest) instead of 10-minute ones")
    ap.add_argument("--rollout-step", action="store_true",
                    help="part 3: one rollout step through bragg-reshard, the gateway, two "
                         "engines, pbox tools and bragg_pack")
    args = ap.parse_args()

    build = Path(args.build).resolve()
    pboxd = build / "src" / "pbox" / "pboxd"
    pkg = build / "python"
    if not pboxd.exists() or not (pkg / "pbox" / "_proto" / "pbox_pb2.py").exists():
        fail(f"{pboxd} or {pkg}/pbox not built: run `make build BUILD={args.build}` first")
        return 2
    if os.geteuid() != 0:
        fail("pboxd needs root (namespaces, mounts, cgroups): run `sudo make demo`")
        return 2
    sys.path.insert(0, str(pkg))
    try:
        import numpy as np  # noqa: F401

        import pbox
    except ImportError as e:
        fail(f"cannot import {e.name}: install python3-numpy python3-grpcio python3-protobuf")
        return 2

    root = Path(tempfile.mkdtemp(prefix="pbox-demo-", dir="/tmp"))
    agent = start_pboxd(build, root, args.sandboxes + 8 if args.skip_rl
                        else max(args.sandboxes + 8, 96))
    if agent is None:
        return 1
    ok = False
    try:
        ok = run_workload(pbox, f"unix://{root}/pbox.sock", args.sandboxes, args.workers)
        if ok and not args.skip_rl:
            import demo_rl

            print("\n== bragg-rl: GRPO on the first X-ray diffraction peak (examples/xrd): "
                  "pboxd, gateway, two engines, trainer, controller ==", flush=True)
            ok = demo_rl.run_rl(build, f"unix://{root}/pbox.sock", root, quick=args.rl_quick)
        if ok and args.rollout_step:
            import demo_rollout

            print("\n== one RL rollout step: bragg-reshard weights, gateway, bragg-engine "
                  "workers (a real Qwen3-MoE), pbox tools, bragg_pack ==", flush=True)
            ok = demo_rollout.run_rollout_step(build, pbox, f"unix://{root}/pbox.sock", root)
    finally:
        if not stop_pboxd(agent):
            ok = False
        if ok and args.skip_rl:
            shutil.rmtree(root, ignore_errors=True)
        elif ok:
            print(f"demo: the RL runs, their plots and the agent's log are kept in {root}")
        else:
            print(f"demo: agent log kept in {root}/pboxd.log", file=sys.stderr)
    print("demo: OK" if ok else "demo: FAILED", flush=True)
    return 0 if ok else 1


def start_pboxd(build: Path, root: Path, max_sandboxes: int):
    """pboxd on unix://ROOT/pbox.sock with its state and log (pboxd.log) in ROOT, once it has
    written its ready file; None (and the log's tail printed) if it did not start in 30 s. The
    demo's and bench/rl/async_sync.py's agent."""
    ready = root / "ready.json"
    with open(root / "pboxd.log", "wb") as log:
        agent = subprocess.Popen(
            [str(build / "src" / "pbox" / "pboxd"), "--listen", f"unix://{root}/pbox.sock",
             "--state-dir", str(root / "state"), "--ready-file", str(ready),
             "--max-sandboxes", str(max_sandboxes), "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if agent.poll() is not None or time.monotonic() > deadline:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            fail(f"pboxd did not start:\n{(root / 'pboxd.log').read_text()[-2000:]}")
            return None
        time.sleep(0.05)
    return agent


def stop_pboxd(agent) -> bool:
    """SIGTERM (SIGKILL after 30 s); True if pboxd exited 0."""
    if agent.poll() is None:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
    if agent.returncode != 0:
        fail(f"pboxd exited with {agent.returncode} on SIGTERM")
        return False
    return True


def run_workload(pbox, endpoint: str, n: int, workers: int) -> bool:
    import numpy as np

    client = pbox.Client(endpoint)
    info = client.info()
    print(f"pboxd {info.version} on {info.hostname}: cpus {info.cpuset}, cgroup "
          f"{info.cgroup_version}; {n} sandboxes, {workers} client threads", flush=True)

    print("preparing inputs and reference results locally...", flush=True)
    ns: Dict = {}
    exec(compile(ANALYSIS, "analysis.py", "exec"), ns)
    inputs, expected = [], []
    for i in range(n):
        buf = io.BytesIO()
        x = make_signal(i)
        np.save(buf, x)
        inputs.append(buf.getvalue())
        expected.append(ns["analyze"](x))

    lat: Dict[str, List[float]] = {"create": [], "exec": [], "roundtrip": [], "total": []}
    errors: List[str] = []
    lock = threading.Lock()
    done = [0]
    moved_bytes = [0]

    sandboxes: List = [None] * n

    def create(session, i: int) -> None:
        t0 = time.monotonic()
        sandboxes[i] = session.create(memory="256M", disk="64M", labels={"demo": str(i)})
        with lock:
            lat["create"].append(time.monotonic() - t0)

    def one(i: int) -> None:
        sb = sandboxes[i]
        t0 = t1 = time.monotonic()
        try:
            sb.write_file("/work/analysis.py", ANALYSIS)
            sb.write_file("/work/input.npy", inputs[i])
            back = sb.read_file("/work/input.npy")
            t2 = time.monotonic()
            if hashlib.sha256(back).digest() != hashlib.sha256(inputs[i]).digest():
                raise AssertionError("input came back different")
            r = sb.run(["/usr/bin/python3", "/work/analysis.py", "/work/input.npy",
                        "/work/result.json"], timeout=120)
            t3 = time.monotonic()
            if not r.ok:
                raise AssertionError(f"analysis {r.describe()}: {r.stderr[-300:]!r}")
            got = json.loads(sb.read_file("/work/result.json"))
            if not same(got, expected[i]):
                raise AssertionError(f"result differs from the local one: {got} vs {expected[i]}")
        finally:
            sb.destroy(missing_ok=True)
        with lock:
            lat["roundtrip"].append(t2 - t1)
            lat["exec"].append(t3 - t2)
            lat["total"].append(time.monotonic() - t0)
            moved_bytes[0] += 2 * len(inputs[i])
            done[0] += 1
            if done[0] % 10 == 0 or done[0] == n:
                print(f"  {done[0]:3d}/{n} sandboxes done", flush=True)

    t_start = time.monotonic()
    with client.session(client_name="make-demo") as session:
        print(f"session {session.id}: creating {n} sandboxes...", flush=True)
        with cf.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(create, session, i): i for i in range(n)}
            for fut in cf.as_completed(futures):
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(f"create {futures[fut]}: {type(e).__name__}: {e}")
        live = len(session.list())
        print(f"{live} sandboxes live at once; running the rollouts...", flush=True)
        if live != n:
            errors.append(f"expected {n} live sandboxes, the agent lists {live}")
        with cf.ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(one, i): i for i in range(n) if sandboxes[i] is not None}
            for fut in cf.as_completed(futures):
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(f"sandbox {futures[fut]}: {type(e).__name__}: {e}")
        live = session.list()
        if live:
            errors.append(f"{len(live)} sandboxes still live after the rollouts")
    elapsed = time.monotonic() - t_start
    left = client.list()
    if left:
        errors.append(f"{len(left)} sandboxes left after the session closed")
    client.close()

    if lat["total"]:
        print()
        print(f"{'latency (ms)':<28}{'p50':>10}{'p99':>10}{'max':>10}")
        rows = [("create sandbox", "create"), ("exec numpy FFT analysis", "exec"),
                ("1 MiB upload+download", "roundtrip"), ("rollout after create", "total")]
        for label, key in rows:
            v = lat[key]
            print(f"{label:<28}{pct(v, 50) * 1e3:>10.1f}{pct(v, 99) * 1e3:>10.1f}"
                  f"{max(v) * 1e3:>10.1f}")
        print()
        print(f"throughput: {done[0] / elapsed:.1f} rollouts/s, "
              f"{moved_bytes[0] / elapsed / (1 << 20):.1f} MiB/s of file transfer "
              f"({done[0]} rollouts in {elapsed:.1f} s)")
    for e in errors[:10]:
        fail(e)
    if len(errors) > 10:
        fail(f"... and {len(errors) - 10} more")
    if done[0] != n:
        fail(f"only {done[0]} of {n} rollouts succeeded")
    return not errors and done[0] == n


if __name__ == "__main__":
    sys.exit(main())
