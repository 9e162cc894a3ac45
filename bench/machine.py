"""The machine a benchmark ran on, and how its children are pinned: helpers every bench driver
shares (bench/engine, bench/train, bench/rl). Stdlib only, for Debian's /usr/bin/python3.

    import machine
    machine.cpu_model(), machine.loadavg(), machine.dpkg_version("libtorch-dev")
    cpus = machine.pinned_cpus(2); argv = machine.pin_prefix(cpus) + [...]
"""

import os
import platform
import shlex
import shutil
import subprocess

DEFAULT_PEER_PYTHON = "/var/cache/bragg/pyenv/bin/python"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def show_argv(argv, tmp):
    """A command as docs/benchmarks.md prints it: temp paths as TMP, paths relative to the root."""
    return " ".join(shlex.quote(x.replace(tmp, "TMP").replace(ROOT + "/", "")) for x in argv)


def cpu_model():
    """/proc/cpuinfo's model name, else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def loadavg():
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def dpkg_version(pkg):
    """The installed Debian package's version, None when it is not installed."""
    p = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", pkg], capture_output=True,
                       text=True)
    return p.stdout.strip() if p.returncode == 0 and p.stdout.strip() else None


def pinned_cpus(threads):
    """The first `threads` CPUs this process may run on (at least one)."""
    return sorted(os.sched_getaffinity(0))[:max(1, threads)]


def pin_prefix(cpus):
    """A taskset prefix pinning a child to `cpus` ([] without taskset)."""
    if shutil.which("taskset"):
        return ["taskset", "-c", ",".join(str(c) for c in cpus)]
    return []


def child_env(threads):
    """This environment with the BLAS/OpenMP thread counts set to `threads`."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def peer_python(build):
    """The Python of the peer environment (transformers, torch): $BRAGG_PEER_PYTHON, else the
    build's BRAGG_PEER_PYTHON cache entry, else scripts/install-deps' default."""
    if os.environ.get("BRAGG_PEER_PYTHON"):
        return os.environ["BRAGG_PEER_PYTHON"]
    try:
        with open(os.path.join(build, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("BRAGG_PEER_PYTHON:"):
                    value = line.split("=", 1)[1].strip()
                    if value:
                        return value
    except OSError:
        pass
    return DEFAULT_PEER_PYTHON
