"""Typed results of pbox calls (plain dataclasses, safe to pickle and compare)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, List

from .errors import CommandError

__all__ = [
    "FileType",
    "FileInfo",
    "SandboxSpec",
    "SandboxInfo",
    "AgentInfo",
    "Health",
    "RunResult",
]


class FileType(enum.IntEnum):
    """Kind of a file, as ``FileType`` in the proto."""

    UNKNOWN = 0
    REGULAR = 1
    DIRECTORY = 2
    SYMLINK = 3
    OTHER = 4


@dataclass(frozen=True)
class FileInfo:
    """One file as the agent saw it.

    ``path`` is the path asked for, or the entry name in :meth:`Sandbox.listdir`.
    """

    path: str
    type: FileType
    size: int
    mode: int
    mtime_unix_ns: int
    symlink_target: str = ""

    @property
    def is_dir(self) -> bool:
        return self.type == FileType.DIRECTORY

    @property
    def is_file(self) -> bool:
        return self.type == FileType.REGULAR

    @property
    def is_symlink(self) -> bool:
        return self.type == FileType.SYMLINK


@dataclass(frozen=True)
class SandboxSpec:
    """A sandbox's spec with the agent's defaults filled in (sizes in bytes)."""

    image: str
    runtime: str
    cpus: int
    cpu_quota: float
    memory_bytes: int
    pids: int
    disk_bytes: int
    env: Dict[str, str]
    workdir: str
    idle_ttl_seconds: int
    labels: Dict[str, str]


@dataclass(frozen=True)
class SandboxInfo:
    """What ``GetSandbox``/``ListSandboxes`` say about one sandbox."""

    id: str
    session_id: str
    spec: SandboxSpec
    state: str  # "running", "destroying" or "unspecified"
    cpuset: str
    created_unix_ms: int
    last_used_unix_ms: int
    running_execs: int
    memory_usage_bytes: int


@dataclass(frozen=True)
class AgentInfo:
    """The agent's description of itself (``Info``)."""

    version: str
    default_runtime: str
    runtimes: List[str]
    cpuset: str
    max_sandboxes: int
    live_sandboxes: int
    images: List[str]
    hostname: str
    cgroup_version: str
    default_memory_bytes: int
    default_disk_bytes: int
    default_pids: int
    #: "root", or "rootless": the agent runs as an ordinary user (docs/security.md).
    mode: str = "root"
    #: the cgroup controllers sandboxes have: which of memory, pids, cpu, cpuset, freezer hold.
    limits: List[str] = field(default_factory=list)
    uid: int = 0
    #: how sandboxes' roots are mounted: "overlayfs" (the kernel's) or "fuse-overlayfs".
    root_fs: str = "overlayfs"


@dataclass(frozen=True)
class Health:
    serving: bool
    live_sandboxes: int


@dataclass
class RunResult:
    """Exactly what happened to one command.

    ``stdout``/``stderr`` are bytes. For :meth:`Sandbox.run` a stream longer than
    ``max_output`` keeps its head and tail with ``"\\n...[N bytes dropped]...\\n"`` between
    them and ``*_truncated`` set. ``exit_code`` is meaningful when ``signal`` is 0 (127: the
    program could not start, see ``error``).
    """

    stdout: bytes = b""
    stderr: bytes = b""
    exit_code: int = 0
    signal: int = 0
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    wall_time_ms: float = 0.0
    cpu_time_ms: float = 0.0
    peak_memory_bytes: int = 0
    error: str = ""
    argv: List[str] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        """True when the command exited 0 on its own (no signal, timeout, OOM or error)."""
        return (
            self.exit_code == 0
            and self.signal == 0
            and not self.timed_out
            and not self.oom_killed
            and not self.error
        )

    @property
    def text(self) -> str:
        """stdout decoded as UTF-8 (invalid bytes replaced)."""
        return self.stdout.decode("utf-8", errors="replace")

    def describe(self) -> str:
        """A one-line human description of how the command ended."""
        if self.error:
            what = f"could not start: {self.error}"
        elif self.timed_out:
            what = f"killed at its timeout after {self.wall_time_ms / 1000:.1f} s"
        elif self.oom_killed:
            what = "killed by the sandbox's out-of-memory killer"
        elif self.signal:
            what = f"killed by signal {self.signal}"
        else:
            what = f"exited with code {self.exit_code}"
        return what

    def check(self) -> "RunResult":
        """Returns self if :attr:`ok`, else raises :class:`pbox.CommandError`."""
        if not self.ok:
            cmd = " ".join(self.argv) if self.argv else "command"
            tail = self.stderr[-400:].decode("utf-8", errors="replace").strip()
            msg = f"{cmd!r} {self.describe()}"
            if tail:
                msg += f"; stderr ends with: {tail}"
            raise CommandError(msg, self)
        return self
