"""What the benchmarks that run the demo task (examples/xrd) share: async_sync.py and
verifier_modes.py. A pboxd of their own with the task's data made, and the record of the run
(command, machine, date). Stdlib only."""

import contextlib
import datetime
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(ROOT / "scripts"))
from machine import cpu_model  # noqa: E402  (bench/machine.py)
import demo  # noqa: E402  (scripts/demo.py: pboxd)
import demo_rl  # noqa: E402  (scripts/demo_rl.py: the demo's configs and runs)


def check_can_run(build: Path, name: str) -> None:
    """Exits with a message when the build lacks a binary the runs need or this is not root."""
    for binary in ("src/rl/bragg-rl", "src/pbox/pboxd", "src/gateway/bragg-gateway"):
        if not os.access(build / binary, os.X_OK):
            sys.exit(f"{name}: {build / binary} is missing: build first")
    if os.geteuid() != 0:
        sys.exit(f"{name}: pboxd needs root (namespaces, mounts, cgroups)")


@contextlib.contextmanager
def agent_and_data(build: Path, prefix: str, log):
    """Yields (work, endpoint, data): a temp directory, a pboxd listening in it and the task's
    data (make_data.py, seed 0, 2,000 warm-start traces) in work/data. The agent is stopped on
    the way out; the directory is removed unless the body raised or the agent did not stop
    cleanly (then it is kept, with the agent's log, and said so)."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    agent = demo.start_pboxd(build, work, 96)
    if agent is None:
        sys.exit(1)
    ok = False
    try:
        data = work / "data"
        subprocess.run([sys.executable, str(demo_rl.XRD / "make_data.py"), "--out", str(data),
                        "--seed", "0", "--warm", "2000"], check=True, stdout=subprocess.DEVNULL)
        yield work, f"unix://{work}/pbox.sock", data
        ok = True
    finally:
        if not demo.stop_pboxd(agent):
            ok = False
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"runs and the agent's log kept in {work}")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def record(script: str, load_start: str) -> dict:
    """The fields every result file starts with: date, command, load, machine."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(shlex.quote(x) for x in [script] + sys.argv[1:]),
        "load_start": load_start,
        "machine": {"cpu_model": cpu_model(), "nproc": os.cpu_count(),
                    "kernel": platform.release()},
    }
