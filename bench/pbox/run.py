#!/usr/bin/python3
"""pbox benchmark driver: starts a pboxd, runs pbox-bench several times with N live sandboxes,
and writes the "## pbox" section of docs/benchmarks.md (min/median/max over the runs, ratios to
the floors measured in the same run) and docs/img/pbox_latency.png.

    bench/pbox/run.py --build build [--sandboxes 100] [--repeat 4] [--rounds 3]

Needs root (pboxd) and the build's pboxd, pbox-init and pbox-bench.
"""

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METRICS = [
    # key, label, floor key (in "floor") or None, target p50 ms or None
    ("create_ms", "create -> ready", None, 10.0),
    ("exec_true_ms", "exec `true`", "exec_true_host_ms", 2.0),
    ("exec_python_ms", "exec `python3 -c pass`", "exec_python_host_ms", None),
    ("rtt_1mib_ms", "1 MiB upload + download", "rtt_1mib_tcp_loopback_ms", 2.0),
    ("rtt_1mib_concurrent_ms", "1 MiB up + down, all at once", None, None),
]


def start_agent(build, tmp, sandboxes):
    ready = os.path.join(tmp, "ready.json")
    sock = os.path.join(tmp, "pbox.sock")
    proc = subprocess.Popen(
        [os.path.join(build, "src/pbox/pboxd"), "--listen", "unix://" + sock,
         "--state-dir", os.path.join(tmp, "state"), "--ready-file", ready,
         "--max-sandboxes", str(sandboxes + 8), "--log-level", "warn"])
    for _ in range(400):
        if os.path.exists(ready):
            return proc, "unix://" + sock
        if proc.poll() is not None:
            sys.exit("bench: pboxd exited early")
        time.sleep(0.05)
    proc.kill()
    sys.exit("bench: pboxd did not become ready")


def summarize(values):
    return min(values), statistics.median(values), max(values)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--sandboxes", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs/benchmarks.md"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench: pboxd needs root")
    bench = os.path.join(args.build, "bench/pbox/pbox-bench")
    runs = []
    tmp = tempfile.mkdtemp(prefix="pbox-bench-")
    proc, endpoint = start_agent(args.build, tmp, args.sandboxes)
    try:
        for i in range(args.repeat):
            out = os.path.join(tmp, f"run{i}.json")
            print(f"bench: pbox run {i + 1}/{args.repeat} ({args.sandboxes} sandboxes)",
                  flush=True)
            subprocess.run([bench, "--endpoint", endpoint, "--sandboxes", str(args.sandboxes),
                            "--rounds", str(args.rounds), "--json", out],
                           check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                runs.append(json.load(f))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

    cmd = (f"bench/pbox/run.py --build {args.build} --sandboxes {args.sandboxes} "
           f"--repeat {args.repeat} --rounds {args.rounds}")
    lines = ["## pbox", "",
             f"{args.sandboxes} live sandboxes (native runtime, host image, 256 MiB each) on one "
             f"pboxd; p50 and p99 per run, then min / median / max over {args.repeat} runs. "
             "The floors are measured in the same run: the same command started directly on "
             "the host with posix_spawn (no isolation), and the same bytes up and back over one "
             "loopback TCP connection.", "",
             "Command (from the repository root, as root, after `make build`):", "",
             "```", cmd, "```", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux "
             f"{platform.release()}; load average {os.getloadavg()[0]:.2f} at the end. "
             f"Measured {time.strftime('%Y-%m-%d')}.", "",
             "| metric | p50 ms (min / median / max) | p99 ms median | floor p50 ms median | "
             "ratio to floor | target p50 |",
             "|---|---|---:|---:|---:|---|"]
    plot_rows = []
    for key, label, floor_key, target in METRICS:
        p50 = summarize([r["metrics"][key]["p50"] for r in runs])
        p99 = summarize([r["metrics"][key]["p99"] for r in runs])
        floor = ratio = ""
        floor_med = None
        if floor_key:
            floor_med = summarize([r["floor"][floor_key]["p50"] for r in runs])[1]
            floor = f"{floor_med:.3f}"
            ratio = f"{p50[1] / floor_med:.2f}x"
        tgt = ""
        if target is not None:
            tgt = f"<= {target:g} ms: {'met' if p50[1] <= target else 'missed'}"
        lines.append(f"| {label} | {p50[0]:.3f} / {p50[1]:.3f} / {p50[2]:.3f} | {p99[1]:.3f} | "
                     f"{floor} | {ratio} | {tgt} |")
        plot_rows.append((label, p50, floor_med))
    tp = summarize([r["throughput_gbps"] for r in runs])
    lines += ["",
              f"Aggregate throughput with all {args.sandboxes} transferring 1 MiB up and down at "
              f"once: {tp[0]:.2f} / {tp[1]:.2f} / {tp[2]:.2f} GB/s (min / median / max).", "",
              "![pbox latency](img/pbox_latency.png)", ""]
    section = "\n".join(lines) + "\n"

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4))
        labels = [r[0] for r in plot_rows[:4]]
        med = [r[1][1] for r in plot_rows[:4]]
        err = [[r[1][1] - r[1][0] for r in plot_rows[:4]], [r[1][2] - r[1][1] for r in plot_rows[:4]]]
        floors = [r[2] or 0 for r in plot_rows[:4]]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], med, 0.4, yerr=err, capsize=4, label="pbox p50")
        ax.bar([x + 0.2 for x in xs], floors, 0.4, label="floor p50 (host / loopback TCP)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms (log)")
        ax.set_title(f"pbox with {args.sandboxes} live sandboxes (min/max over {args.repeat} runs)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        os.makedirs(os.path.join(os.path.dirname(args.doc), "img"), exist_ok=True)
        fig.savefig(os.path.join(os.path.dirname(args.doc), "img/pbox_latency.png"), dpi=110)
    except ImportError:
        print("bench: python3-matplotlib missing, no plot", file=sys.stderr)

    text = open(args.doc).read() if os.path.exists(args.doc) else "# Benchmarks\n\n"
    pattern = re.compile(r"^## pbox\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(args.doc, "w") as f:
        f.write(text)
    print(section)


if __name__ == "__main__":
    main()
