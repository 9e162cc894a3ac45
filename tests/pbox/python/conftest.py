"""Fixtures for the pbox Python suite: real pboxd agents in temp dirs.

The agent binary comes from $PBOXD (set by ctest) or the usual build directories; the package
from $PYTHONPATH (ctest points it at <build>/python). Tests skip when not root or when the
binary is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parents[3]


def _find_pboxd() -> Optional[str]:
    env = os.environ.get("PBOXD")
    if env:
        return env
    for build in ("build", "build-py", "build-agent"):
        p = REPO / build / "src" / "pbox" / "pboxd"
        if p.exists():
            return str(p)
    return None


def _ensure_import_path() -> None:
    try:
        import pbox  # noqa: F401
    except ImportError:
        import sys

        for build in ("build", "build-py"):
            p = REPO / build / "python"
            if (p / "pbox" / "_proto" / "pbox_pb2.py").exists():
                sys.path.insert(0, str(p))
                return


_ensure_import_path()

import pbox  # noqa: E402

# Beside this file; other suites (tests/pbox/chaos) load this conftest from elsewhere.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import rootless_user  # noqa: E402


class Agent:
    """One pboxd process with its own state dir and socket, under a temp dir (owned)."""

    def __init__(self, binary: str, root: Path, extra: Optional[List[str]] = None,
                 tcp_token: Optional[str] = None, rootless: Optional[bool] = None) -> None:
        self.binary = binary
        self.root = root
        self.state_dir = root / "state"
        self.socket = root / "pbox.sock"
        self.ready_file = root / "ready.json"
        self.log_path = root / "pboxd.log"
        self.extra = list(extra or [])
        # --runtime / $PBOX_TEST_RUNTIME: the agent's default runtime (native or gvisor).
        if TEST_RUNTIME:
            self.extra = ["--runtime", TEST_RUNTIME] + self.extra
        # $PBOX_TEST_ROOTLESS: pboxd runs as an ordinary user in a cgroup delegated to it
        # (rootless_user.py); made at the first start, kept by restarts.
        if rootless is None:
            rootless = rootless_user.ROOTLESS
        self.user = rootless_user.ensure_user() if rootless else None
        if self.user is not None and rootless_user.OVERLAY and "--overlay" not in self.extra:
            self.extra += ["--overlay", rootless_user.OVERLAY]
        if self.user is not None and "fuse" in self.extra:
            rootless_user.open_dev_fuse()
        self.delegation: Optional[rootless_user.DelegatedCgroup] = None
        if self.user is not None:
            rootless_user.chown_tree(root, self.user)
        self.token_file: Optional[Path] = None
        if tcp_token is not None:
            self.token_file = root / "token"
            self.token_file.write_text(tcp_token + "\n")
            os.chmod(self.token_file, 0o600)
            rootless_user.chown_tree(self.token_file, self.user)
        self.proc: Optional[subprocess.Popen] = None
        self.endpoints: List[str] = []

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    @property
    def tcp_endpoint(self) -> str:
        return next(e for e in self.endpoints if e.startswith("tcp://"))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 30.0) -> "Agent":
        if self.ready_file.exists():
            self.ready_file.unlink()
        args = [self.binary, "--listen", self.endpoint, "--state-dir", str(self.state_dir),
                "--ready-file", str(self.ready_file), "--log-level", "info"]
        if self.token_file is not None:
            args += ["--listen", "tcp://127.0.0.1:0", "--token-file", str(self.token_file)]
        args += self.extra
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._argv(args), stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=self._preexec())
        log.close()
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"pboxd exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"pboxd not ready within {timeout} s:\n{self.log()}")
            time.sleep(0.02)
        ready = json.loads(self.ready_file.read_text())
        assert ready["pid"] == self.proc.pid
        if self.user is not None:
            # A rootless run that silently ran pboxd as root would prove nothing.
            uids = Path(f"/proc/{self.proc.pid}/status").read_text().split("\nUid:")[1].split()
            assert int(uids[1]) == self.user.pw_uid, f"pboxd runs as euid {uids[1]}"
        self.endpoints = ready["endpoints"]
        return self

    def _argv(self, args: List[str]) -> List[str]:
        return args if self.user is None else rootless_user.as_user(self.user, args)

    def _preexec(self):
        """Rootless: the child enters the delegated cgroup while still root."""
        if self.user is None:
            return None
        if self.delegation is None:
            self.delegation = rootless_user.DelegatedCgroup(self.user)
        return self.delegation.enter

    def remove_delegation(self) -> List[str]:
        """Rootless: removes the delegated cgroup once the agent is gone; what would not go."""
        if self.delegation is None or self.alive():
            return []
        left = self.delegation.remove()
        self.delegation = None
        return left

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def client(self, **kw) -> pbox.Client:
        return pbox.Client(self.endpoint, **kw)

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"pboxd did not stop on SIGTERM within {timeout} s")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def needs_reap(self) -> bool:
        """Killed or crashed and not restarted: its sandboxes, mounts and cgroup parent stay
        until `pboxd --reap` (a clean exit removes them itself)."""
        return self.proc is not None and self.proc.poll() is not None and self.proc.returncode != 0

    def reap_args(self) -> List[str]:
        args = [self.binary, "--reap", "--state-dir", str(self.state_dir)]
        for flag in ("--cgroup", "--cgroup-parent"):
            if flag in self.extra:
                args += [flag, self.extra[self.extra.index(flag) + 1]]
        return args

    def run_like_agent(self, argv: List[str], **kw) -> subprocess.CompletedProcess:
        """Runs argv (pboxd --reap, say) as the agent ran: its user, its cgroup."""
        return subprocess.run(self._argv(argv), capture_output=True, text=True,
                              preexec_fn=self._preexec(), **kw)

    def reap(self, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Runs `pboxd --reap` on this agent's state dir (the agent must be dead)."""
        return self.run_like_agent(self.reap_args(), timeout=timeout)

    def cgroup_parents(self) -> List[Path]:
        """The agent's parent cgroup directories that exist now. It started in this process's
        cgroups (it is our child). On cgroup v2 it moved every process of its cgroup, this one
        too, into the leaf "agent" and keeps its parent beside that leaf."""
        name = cgroup_parent_name(str(self.state_dir))
        if "--cgroup-parent" in self.extra:
            name = self.extra[self.extra.index("--cgroup-parent") + 1]
        found = []
        started_in = self.delegation.dirs if self.delegation is not None else own_cgroup_dirs()
        for d in started_in:
            for base in ([d, d.parent] if d.name == "agent" else [d]):
                if (base / name).is_dir() and base / name not in found:
                    found.append(base / name)
        return found


def cgroup_parent_name(state_dir: str) -> str:
    """pboxd's default --cgroup-parent for a --state-dir (FNV-1a of the absolute, lexically
    normal path, as in agent.cc)."""
    key = os.path.normpath(os.path.abspath(state_dir))
    h = 2166136261
    for c in key.encode():
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return f"pbox-{h:08x}"


def own_cgroup_dirs(root: str = "/sys/fs/cgroup") -> List[Path]:
    """This process's cgroup directory in every mounted hierarchy (v1 and v2)."""
    dirs = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return dirs
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        mounts = [controllers] + controllers.split(",") if controllers else ["", "unified"]
        for m in mounts:
            m = m.replace("name=", "")
            d = Path(root) / m / rel if m else Path(root) / rel
            if d.is_dir() and d not in dirs:
                dirs.append(d)
    return dirs


# Every agent the session started: none may leave its parent cgroup behind.
_ALL_AGENTS: List[Agent] = []


# The runtime the suite's agents default to: `pytest --runtime gvisor` or
# PBOX_TEST_RUNTIME=gvisor; empty: the agent's own default (native).
TEST_RUNTIME = os.environ.get("PBOX_TEST_RUNTIME", "")


def pytest_addoption(parser) -> None:
    parser.addoption("--runtime", default=None,
                     help="default runtime of the agents under test: native or gvisor")


def pytest_configure(config) -> None:
    global TEST_RUNTIME
    if config.getoption("--runtime"):
        TEST_RUNTIME = config.getoption("--runtime")


def on_rootless() -> bool:
    """Agents run as an ordinary user ($PBOX_TEST_ROOTLESS): native runtime only."""
    return rootless_user.ROOTLESS


def on_gvisor() -> bool:
    """For tests that cannot hold under gVisor (skip them with the reason)."""
    return TEST_RUNTIME == "gvisor"


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("pboxd needs root (namespaces, mounts, cgroups)")


@pytest.fixture(scope="session")
def pboxd_binary() -> str:
    _require_root()
    binary = _find_pboxd()
    if binary is None or not os.access(binary, os.X_OK):
        pytest.skip("pboxd binary not found: build it or set $PBOXD")
    if on_gvisor() and shutil.which("runsc") is None and not os.access("/usr/sbin/runsc", os.X_OK):
        pytest.skip("runsc is not installed (Debian package runsc): no gVisor runtime here")
    return binary


def _tempdir(rootless: Optional[bool] = None) -> Path:
    # Unix socket paths are limited to 108 bytes: keep the root short.
    if rootless_user.ROOTLESS if rootless is None else rootless:
        return rootless_user.owned_tempdir(rootless_user.ensure_user())
    return Path(tempfile.mkdtemp(prefix="pbx-", dir="/tmp"))


class AgentFactory:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.agents: List[Agent] = []
        self.dirs: List[Path] = []

    def __call__(self, extra: Optional[List[str]] = None, tcp_token: Optional[str] = None,
                 root: Optional[Path] = None, start: bool = True,
                 rootless: Optional[bool] = None) -> Agent:
        """rootless: run this agent as the test's ordinary user (default $PBOX_TEST_ROOTLESS)."""
        if root is None:
            root = _tempdir(rootless)
            self.dirs.append(root)
        agent = Agent(self.binary, root, extra, tcp_token, rootless)
        self.agents.append(agent)
        _ALL_AGENTS.append(agent)
        return agent.start() if start else agent

    def cleanup(self) -> None:
        failures = []
        for a in self.agents:
            try:
                a.stop()
            except AssertionError:
                pass
        # Killed agents are not all restarted: reap what they left, as an epilog would. Agents
        # sharing a state dir (restarts) reap once, the first dead one without a live twin.
        live_states = {a.state_dir for a in self.agents if a.alive()}
        reaped = set()
        for a in self.agents:
            if not a.needs_reap() or a.state_dir in live_states or a.state_dir in reaped:
                continue
            reaped.add(a.state_dir)
            r = a.reap()
            if r.returncode != 0:
                failures.append(f"pboxd --reap {a.state_dir}: {r.returncode}: {r.stderr}")
        # A parent cgroup left by a stopped (or reaped) agent is a leak; rootless, checked
        # before the delegated cgroup holding it is removed with its agent.
        for a in self.agents:
            if a.alive():
                continue
            left = [str(p) for p in a.cgroup_parents()]
            if left:
                failures.append(f"agent {a.state_dir} left its parent cgroups {left}")
            if a.delegation is None:
                continue
            left = a.remove_delegation()
            if left:
                failures.append(f"delegated cgroups that would not go: {left}")
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        assert not failures, failures


@pytest.fixture(scope="session", autouse=True)
def no_leftover_cgroup_parents() -> Iterator[None]:
    """At the end of the session no agent it started has left its parent cgroup behind. Agents
    still running are not judged here: pytest 7 may finalize this fixture before a session
    agent's (it re-registers a fixture's finalizer at each test using it, so when the last test
    does not use that agent, this one runs first); their factories check them once stopped."""
    yield
    left = [str(p) for a in _ALL_AGENTS if not a.alive() for p in a.cgroup_parents()]
    assert not left, f"pbox parent cgroups left behind by the suite's agents: {left}"


@pytest.fixture
def make_agent(pboxd_binary: str) -> Iterator[AgentFactory]:
    """Starts agents of a test's own (killed and removed at the end of the test)."""
    factory = AgentFactory(pboxd_binary)
    yield factory
    factory.cleanup()


@pytest.fixture(scope="session")
def agent(pboxd_binary: str) -> Iterator[Agent]:
    """One agent shared by the suite (tests create and destroy their own sandboxes)."""
    factory = AgentFactory(pboxd_binary)
    a = factory(extra=["--max-sandboxes", "64"])
    yield a
    assert a.alive(), f"the shared agent died during the suite:\n{a.log()}"
    factory.cleanup()


@pytest.fixture
def client(agent: Agent) -> Iterator[pbox.Client]:
    c = agent.client()
    yield c
    c.close()


@pytest.fixture
def session(client: pbox.Client) -> Iterator[pbox.Session]:
    with client.session(client_name="pytest") as s:
        yield s


@pytest.fixture
def sandbox(session: pbox.Session) -> pbox.Sandbox:
    return session.create(memory="512M", disk="256M")


def wait_for(predicate, timeout: float = 10.0) -> bool:
    """Polls `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _host_cmdlines() -> Iterator[Tuple[int, bytes]]:
    """(pid, raw /proc/PID/cmdline) of every host process that can be read now."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                yield int(entry), f.read()
        except OSError:
            continue


def fuse_overlayfs_daemons(state_dir: Path) -> List[int]:
    """Pids of fuse-overlayfs processes mounting under `state_dir` (a rootless agent's with
    --overlay fuse: one per live sandbox)."""
    want = str(state_dir).encode()
    out = []
    for pid, raw in _host_cmdlines():
        argv = raw.split(b"\0")
        if argv[0].endswith(b"fuse-overlayfs") and any(want in a for a in argv):
            out.append(pid)
    return out


def host_processes_with_argv(argv: List[str]) -> List[int]:
    """Pids of host processes whose exact argv is ``argv``."""
    want = "\0".join(argv).encode() + b"\0"
    return [pid for pid, raw in _host_cmdlines() if raw == want]


def assert_agent_fine(agent: Agent, client: pbox.Client, other: pbox.Sandbox,
                      rss_limit: int = 200 << 20) -> None:
    """The agent serves, another sandbox still runs `true`, the agent's RSS is bounded."""
    assert agent.alive(), agent.log()
    assert client.health().serving
    r = other.run(["true"], timeout=30)
    assert r.ok, r
    rss = agent.rss_bytes()
    assert rss < rss_limit, f"agent RSS {rss >> 20} MiB"
