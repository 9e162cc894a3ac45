"""Shared pieces of the benchmark peers (bench/peers/*_peer.py): the output contract of
pbox-bench, its percentile rule, and timing of commands.

A peer is run as

    bench/peers/NAME_peer.py --sandboxes N --rounds R --tool-samples K --tools DIR --json OUT

and writes one JSON object: "runtime" (the peer's name), "sandboxes", "metrics" (create_ms,
exec_true_ms, exec_python_ms, rtt_1mib_ms, rtt_1mib_concurrent_ms -> {"p50", "p99", "n"}),
"throughput_gbps", "tools" ({NAME: {"p50", "p99", "n", "ms": [wall ms, seed order]}}) and
"notes" (strings for the report). Exit status SKIP (3) means the peer cannot run here; its
last line on stderr says why.
"""

import json
import os
import subprocess
import sys
import time

SKIP = 3
METRICS = ("create_ms", "exec_true_ms", "exec_python_ms", "rtt_1mib_ms", "rtt_1mib_concurrent_ms")
MIB = 1 << 20


def pct(values, p):
    """The same rule as pbox-bench: nearest rank of p/100 * (n - 1)."""
    if not values:
        return 0.0
    v = sorted(values)
    idx = int(p / 100.0 * (len(v) - 1) + 0.5)
    return v[min(idx, len(v) - 1)]


def summary(values):
    return {"p50": pct(values, 50), "p99": pct(values, 99), "n": len(values)}


def tools_json(names, ms):
    """names[t], ms[t][k] -> the "tools" object."""
    out = {}
    for name, times in zip(names, ms):
        entry = summary(times)
        entry["ms"] = list(times)
        out[name] = entry
    return out


def load_tools(directory):
    """Sorted (name, path) of the NAME.py tool scripts in directory."""
    return sorted((f[:-3], os.path.join(directory, f)) for f in os.listdir(directory)
                  if f.endswith(".py") and os.path.isfile(os.path.join(directory, f)))


def skip(why):
    print(f"skipped: {why}", file=sys.stderr)
    sys.exit(SKIP)


def timed(argv, check=True, **kwargs):
    """Runs argv to completion; returns (wall ms, CompletedProcess)."""
    t0 = time.monotonic()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    ms = (time.monotonic() - t0) * 1000.0
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {proc.returncode}: "
                           f"{proc.stderr.decode(errors='replace').strip()[-500:]}")
    return ms, proc


def write_result(out_path, runtime, sandboxes, metrics, throughput_gbps, tools, notes):
    missing = [m for m in METRICS if m not in metrics]
    if missing:
        raise ValueError(f"peer result lacks {missing}")
    result = {"runtime": runtime, "sandboxes": sandboxes, "metrics": metrics,
              "throughput_gbps": throughput_gbps, "tools": tools, "notes": notes}
    text = json.dumps(result, indent=2) + "\n"
    if out_path:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, out_path)
    print(text)
