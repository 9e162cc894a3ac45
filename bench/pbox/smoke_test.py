#!/usr/bin/python3
"""Smoke test of the pbox benchmark's output contract (ctest pbox_bench_smoke).

Runs pbox-bench against a fresh pboxd with a tiny configuration and checks the JSON that
scripts depend on: every field present, counts as configured, positive numbers, p50 <= p99,
the floor in the same shape, one timing per tool execution; that a runtime the agent does not
offer exits 3 (the driver's "skip") and bad arguments exit 2. Then the podman peer's JSON,
when podman can run here (skipped with a note otherwise).

    smoke_test.py PBOXD PBOX_BENCH
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METRICS = ["create_ms", "exec_true_ms", "exec_python_ms", "rtt_1mib_ms", "rtt_1mib_concurrent_ms"]
# Beyond the contract: every system's create and first `true`; runsc's `runsc run` alone.
CREATE_EXEC = ["create_exec_ms"]
RUNSC_EXTRA = ["create_exec_ms", "create_runsc_ms"]
# Two cheap tools stand in for bench/pbox/tools (whose numpy and scipy imports cost seconds on
# a loaded machine): the contract is the same, and --tools is exercised.
TOOLS = ["echo_seed", "write_file"]
TOOL_TEXT = {
    "echo_seed": "import sys\nprint(int(sys.argv[1]))\n",
    "write_file": "import os, sys\np = f'/tmp/bragg-smoke-{os.getpid()}-{sys.argv[1]}'\n"
                  "open(p, 'w').write('x')\nok = open(p).read() == 'x'\nos.unlink(p)\n"
                  "sys.exit(0 if ok else 1)\n",
}
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}", flush=True)


def positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_shape(d, who, sandboxes, counts, tool_samples, metrics=METRICS):
    check(isinstance(d.get("runtime"), str) and d["runtime"], f"{who}: runtime names it")
    check(d.get("sandboxes") == sandboxes, f"{who}: sandboxes == {sandboxes}")
    m = d.get("metrics", {})
    check(sorted(m) == sorted(metrics), f"{who}: metrics are exactly {metrics}, got {sorted(m)}")
    for key in metrics:
        e = m.get(key, {})
        check(positive(e.get("p50")) and positive(e.get("p99")),
              f"{who}: {key} p50 and p99 positive ({e})")
        if positive(e.get("p50")) and positive(e.get("p99")):
            check(e["p50"] <= e["p99"], f"{who}: {key} p50 <= p99 ({e})")
        if key in counts:
            check(e.get("n") == counts[key], f"{who}: {key} n == {counts[key]} ({e.get('n')})")
    # Create and a first command take longer than the create alone; `runsc run` alone, less.
    for longer, shorter in (("create_exec_ms", "create_ms"), ("create_ms", "create_runsc_ms")):
        if longer in m and shorter in m:
            check(m[longer].get("p50", 0) >= m[shorter].get("p50", 1),
                  f"{who}: {longer} p50 >= {shorter} p50 ({m[longer]}, {m[shorter]})")
    check(positive(d.get("throughput_gbps")), f"{who}: throughput_gbps positive")
    tools = d.get("tools", {})
    want = TOOLS if tool_samples else []
    check(sorted(tools) == want, f"{who}: tools {want}, got {sorted(tools)}")
    for name, e in tools.items():
        ms = e.get("ms", [])
        check(len(ms) == tool_samples and all(positive(x) for x in ms),
              f"{who}: tool {name} has {tool_samples} positive timings ({ms})")
        check(e.get("p50", 0) <= e.get("p99", -1), f"{who}: tool {name} p50 <= p99")


def skipped(what):
    """Prints a skipped part and adds it to make test's list of skips ($BRAGG_SKIP_FILE)."""
    print(f"{what} skipped" if ":" not in what else what.replace(":", " skipped:", 1))
    if os.environ.get("BRAGG_SKIP_FILE"):
        with open(os.environ["BRAGG_SKIP_FILE"], "a") as f:
            f.write(f"smoke_test.py: {what}\n")


def main():
    pboxd, bench = sys.argv[1], sys.argv[2]
    if os.geteuid() != 0:
        skipped("all: pboxd needs root")
        return 77
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="pbox-bench-smoke-")
    sock = os.path.join(tmp, "pbox.sock")
    agent = subprocess.Popen([pboxd, "--listen", "unix://" + sock, "--state-dir",
                              os.path.join(tmp, "state"), "--ready-file",
                              os.path.join(tmp, "ready"), "--log-level", "warn"])
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(tmp, "ready")):
            if agent.poll() is not None or time.monotonic() > deadline:
                print("FAIL: pboxd did not become ready")
                return 1
            time.sleep(0.05)
        base = [bench, "--endpoint", "unix://" + sock]
        tools = os.path.join(tmp, "tools")
        os.mkdir(tools)
        for name, text in TOOL_TEXT.items():
            with open(os.path.join(tools, name + ".py"), "w") as f:
                f.write(text)
        with open(os.path.join(tools, "README"), "w") as f:
            f.write("not a tool: only NAME.py files are\n")

        out = os.path.join(tmp, "pbox.json")
        p = subprocess.run(base + ["--sandboxes", "3", "--rounds", "2", "--tool-samples", "2",
                                   "--tools", tools, "--json", out], capture_output=True, text=True, timeout=120)
        check(p.returncode == 0, f"pbox-bench exits 0 ({p.returncode}: {p.stderr[-800:]})")
        if p.returncode == 0:
            with open(out) as f:
                d = json.load(f)
            check(json.loads(p.stdout) == d, "stdout and --json hold the same object")
            counts = {"create_ms": 3, "create_exec_ms": 3, "exec_true_ms": 6,
                      "exec_python_ms": 6, "rtt_1mib_ms": 6, "rtt_1mib_concurrent_ms": 6}
            check_shape(d, "pbox-bench", 3, counts, 2, METRICS + CREATE_EXEC)
            floor = d.get("floor", {})
            check(floor.get("runtime") == "floor", "floor: runtime is 'floor'")
            check_shape(floor, "floor", 3, {"rtt_1mib_concurrent_ms": 6}, 2,
                        [m for m in METRICS if m != "create_ms"])

        # A tool that fails inside the sandbox fails the benchmark (no silent timings).
        with open(os.path.join(tools, "zz_fails.py"), "w") as f:
            f.write("import sys\nsys.exit('tool broke')\n")
        p = subprocess.run(base + ["--sandboxes", "1", "--rounds", "1", "--tool-samples", "1",
                                   "--tools", tools], capture_output=True, text=True, timeout=120)
        check(p.returncode != 0 and "tool broke" in p.stderr,
              f"a failing tool fails pbox-bench with its stderr ({p.returncode}: "
              f"{p.stderr[-300:]})")
        os.unlink(os.path.join(tools, "zz_fails.py"))
        p = subprocess.run(base + ["--sandboxes", "1", "--runtime", "no-such-runtime"],
                           capture_output=True, text=True, timeout=60)
        check(p.returncode == 3 and "does not offer runtime no-such-runtime" in p.stderr,
              f"an unknown runtime exits 3 with a note ({p.returncode}: {p.stderr[-300:]})")
        p = subprocess.run(base + ["--sandboxes", "0"], capture_output=True, text=True,
                           timeout=60)
        check(p.returncode == 2, f"--sandboxes 0 is refused with exit 2 ({p.returncode})")
        p = subprocess.run(base + ["--sandboxes", "1", "--tools", os.path.join(tmp, "none")],
                           capture_output=True, text=True, timeout=60)
        check(p.returncode != 0 and "--tools" in p.stderr,
              f"a missing --tools directory fails clearly ({p.returncode}: {p.stderr[-300:]})")
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
    print(f"pbox part: {time.monotonic() - t0:.1f} s", flush=True)

    out = os.path.join(tmp, "podman.json")
    t1 = time.monotonic()
    p = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "bench/peers/podman_peer.py"),
                        "--sandboxes", "1", "--rounds", "1", "--tool-samples", "1",
                        "--tools", tools, "--json", out], capture_output=True, text=True, timeout=300)
    if p.returncode == 3:
        skipped(f"podman peer: {p.stderr.strip().splitlines()[-1]}")
    else:
        check(p.returncode == 0, f"podman peer exits 0 or 3 ({p.returncode}: {p.stderr[-800:]})")
        if p.returncode == 0:
            with open(out) as f:
                d = json.load(f)
            check(d.get("runtime") == "podman-runc", "podman peer: runtime is podman-runc")
            check_shape(d, "podman peer", 1, {m: 1 for m in METRICS + CREATE_EXEC}, 1,
                        METRICS + CREATE_EXEC)
        print(f"podman part: {time.monotonic() - t1:.1f} s")

    # The gVisor runtime's peer: runsc by hand on pbox-init (the one beside pboxd); no tools,
    # which take seconds each under gVisor.
    out = os.path.join(tmp, "runsc.json")
    t2 = time.monotonic()
    p = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "bench/peers/runsc_peer.py"),
                        "--sandboxes", "1", "--rounds", "1", "--tool-samples", "0",
                        "--tools", tools, "--json", out], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PBOX_INIT=os.path.join(
                           os.path.dirname(os.path.abspath(pboxd)), "pbox-init")))
    if p.returncode == 3:
        skipped(f"runsc peer: {p.stderr.strip().splitlines()[-1]}")
    else:
        check(p.returncode == 0, f"runsc peer exits 0 or 3 ({p.returncode}: {p.stderr[-800:]})")
        if p.returncode == 0:
            with open(out) as f:
                d = json.load(f)
            check(d.get("runtime") == "runsc-by-hand", "runsc peer: runtime is runsc-by-hand")
            check(d.get("peer_of") == "gvisor", "runsc peer: the peer of pbox's gVisor runtime")
            check_shape(d, "runsc peer", 1, {m: 1 for m in METRICS + RUNSC_EXTRA}, 0,
                        METRICS + RUNSC_EXTRA)
        print(f"runsc part: {time.monotonic() - t2:.1f} s")

        # The isolated runsc peer: pbox-init --isolate with the program pboxd wrote.
        program = os.path.join(tmp, "state/gvisor/seccomp.bpf")
        out = os.path.join(tmp, "runsc-isolated.json")
        env = dict(os.environ, PBOX_INIT=os.path.join(os.path.dirname(os.path.abspath(pboxd)),
                                                      "pbox-init"), PBOX_INIT_SECCOMP=program)
        argv = ["/usr/bin/python3", os.path.join(ROOT, "bench/peers/runsc_isolated_peer.py"),
                "--sandboxes", "1", "--rounds", "1", "--tool-samples", "0", "--tools", tools]
        if not os.path.isfile(program):
            print("isolated runsc peer not run: this pboxd offers no gVisor runtime")
        else:
            t3 = time.monotonic()
            p = subprocess.run(argv + ["--json", out], capture_output=True, text=True,
                               timeout=120, env=env)
            check(p.returncode == 0, f"isolated runsc peer exits 0 ({p.returncode}: "
                  f"{p.stderr[-800:]})")
            if p.returncode == 0:
                with open(out) as f:
                    d = json.load(f)
                check(d.get("runtime") == "runsc-by-hand-pinned-isolated",
                      f"isolated runsc peer: runtime ({d.get('runtime')})")
                check_shape(d, "isolated runsc peer", 1,
                            {m: 1 for m in METRICS + RUNSC_EXTRA}, 0, METRICS + RUNSC_EXTRA)
            print(f"isolated runsc part: {time.monotonic() - t3:.1f} s")
        # Without a program it is skipped with a note, not run unisolated.
        env["PBOX_INIT_SECCOMP"] = os.path.join(tmp, "no-such-program")
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        check(p.returncode == 3 and "seccomp" in p.stderr,
              f"isolated runsc peer without a program exits 3 ({p.returncode}: "
              f"{p.stderr[-300:]})")
    shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
