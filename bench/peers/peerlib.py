"""Shared pieces of the benchmark peers (bench/peers/*_peer.py): the output contract of
pbox-bench, its percentile rule, and timing of commands.

A peer is run as

    bench/peers/NAME_peer.py --sandboxes N --rounds R --tool-samples K --tools DIR --json OUT

and writes one JSON object: "runtime" (the peer's name), "sandboxes", "metrics" (create_ms,
exec_true_ms, exec_python_ms, rtt_1mib_ms, rtt_1mib_concurrent_ms -> {"p50", "p99", "n"}),
"throughput_gbps", "tools" ({NAME: {"p50", "p99", "n", "ms": [wall ms, seed order]}}),
"notes" (strings for the report) and "peer_of" (the pbox runtime it is the alternative to:
"native" or "gvisor"; the report's ratios are to that one). Exit status SKIP (3) means the peer cannot run here; its
last line on stderr says why.
"""

import concurrent.futures
import json
import os
import shutil
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


def round_trips(round_trip, n, rounds, label):
    """1 MiB round trips: each of the n sandboxes in turn, then all n at once, `rounds` times.
    `round_trip(i)` returns one round trip's ms. Returns (one at a time, all at once, GB/s)."""
    rtt = [round_trip(i) for _ in range(rounds) for i in range(n)]
    rtt_conc = []
    t_all = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        for _ in range(rounds):
            rtt_conc += list(pool.map(round_trip, range(n)))
    gbps = 2.0 * MIB * n * rounds / (time.monotonic() - t_all) / 1e9
    print(f"{label}: 1 MiB round trip p50 {pct(rtt, 50):.1f} ms; all at once p50 "
          f"{pct(rtt_conc, 50):.1f} ms, {gbps:.3f} GB/s", file=sys.stderr)
    return rtt, rtt_conc, gbps


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


def write_result(out_path, runtime, sandboxes, metrics, throughput_gbps, tools, notes,
                 peer_of="native"):
    """`peer_of`: the pbox runtime this peer is the alternative to (its ratios are to it)."""
    missing = [m for m in METRICS if m not in metrics]
    if missing:
        raise ValueError(f"peer result lacks {missing}")
    result = {"runtime": runtime, "sandboxes": sandboxes, "metrics": metrics,
              "throughput_gbps": throughput_gbps, "tools": tools, "notes": notes,
              "peer_of": peer_of}
    text = json.dumps(result, indent=2) + "\n"
    if out_path:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, out_path)
    print(text)


# Host /etc entries copied into a skeleton root (the list of src/pbox/image/image_store.cc).
ETC_COPIES = ["ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "python3",
              "python3.11", "localtime", "os-release", "debian_version", "ssl",
              "ca-certificates.conf", "profile", "mime.types", "protocols", "services",
              "matplotlibrc"]


def make_skeleton(skel):
    """Builds at `skel` a root like pbox's "host" image: merged-/usr links, an empty /usr for
    the host's to be bound on read-only, a few host /etc files. Returns `skel`."""
    for d in ["etc", "usr", "proc", "dev", "sys", "run", "root", "home", "var/tmp", "var/lib",
              "var/cache", "opt", "workspace", "tmp"]:
        os.makedirs(os.path.join(skel, d), exist_ok=True)
    os.chmod(os.path.join(skel, "tmp"), 0o1777)
    os.chmod(os.path.join(skel, "var/tmp"), 0o1777)
    for link in ["bin", "sbin", "lib", "lib32", "lib64", "libx32"]:
        if os.path.lexists(os.path.join("/usr", link)):
            os.symlink(f"usr/{link}", os.path.join(skel, link))
    for name in ETC_COPIES:
        src = os.path.join("/etc", name)
        dst = os.path.join(skel, "etc", name)
        if os.path.isdir(src) and not os.path.islink(src):
            shutil.copytree(src, dst, symlinks=True)
        elif os.path.lexists(src):
            shutil.copy2(src, dst, follow_symlinks=False)
    with open(os.path.join(skel, "etc/passwd"), "w") as f:
        f.write("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:"
                "/usr/sbin/nologin\n")
    with open(os.path.join(skel, "etc/group"), "w") as f:
        f.write("root:x:0:\nnogroup:x:65534:\n")
    return skel
