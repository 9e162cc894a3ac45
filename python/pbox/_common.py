"""Helpers shared by the blocking and the asyncio clients (not public API)."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from ._proto import pbox_pb2 as pb
from .types import AgentInfo, FileInfo, FileType, Health, RunResult, SandboxInfo, SandboxSpec

DEFAULT_ENDPOINT = "unix:///run/pbox/pbox.sock"


def default_endpoint() -> str:
    """The agent a client finds with no endpoint given, by pboxd's rule
    (src/pbox/wire/default_paths.h): the system agent's socket when it exists or we are root,
    else our own user's ($XDG_RUNTIME_DIR/pbox, or /tmp/pbox-<uid>: a rootless agent)."""
    euid = os.geteuid()
    if euid == 0 or os.path.exists(DEFAULT_ENDPOINT[len("unix://"):]):
        return DEFAULT_ENDPOINT
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    run_dir = xdg + "/pbox" if xdg.startswith("/") else f"/tmp/pbox-{euid}"
    return f"unix://{run_dir}/pbox.sock"
CHUNK_BYTES = 256 * 1024
# The agent accepts and sends messages up to 16 MiB; leave room on our side for Run output
# (head and tail of two streams).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024

Size = Union[int, str, None]
Argv = Union[str, Sequence[str]]

# The agent's size grammar (src/common/units.cc ParseSize), which this must follow exactly:
# ASCII digits and dots forming one decimal number, then an optional unit, case-insensitive, no
# spaces; binary multiples; rounded half away from zero; below 9.2e18 bytes. Both are checked
# against tests/data/sizes.json.
_SIZE_RE = re.compile(r"([0-9.]+)([A-Za-z]*)")
_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
    "p": 1 << 50, "pb": 1 << 50, "pib": 1 << 50,
}
_MAX_SIZE = 9.2e18


def _round_bytes(number: float) -> Optional[int]:
    """``number`` bytes rounded half away from zero (C's llround); None past the limit."""
    if not math.isfinite(number) or number < 0 or number >= _MAX_SIZE:
        return None
    whole = math.floor(number)
    return int(whole) + (1 if number - whole >= 0.5 else 0)


def parse_size(value: Size, what: str = "size") -> int:
    """Bytes from an int or a string like ``"512M"``, ``"1G"``, ``"1.5GiB"``, ``"4096"``.

    Units are powers of 1024 (K, M, G, T, P, each also as KB or KiB, any case); fractions are
    rounded to the nearest byte. ``None`` means 0 (the agent's default).

    Raises:
        ValueError: the value is negative, not a number, has an unknown unit, or is 9.2e18
            bytes or more.
    """
    if value is None:
        return 0
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size such as 536870912, '512M' or '1G', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: size must not be negative, got {value}")
        return value
    if isinstance(value, float):
        rounded = _round_bytes(value)
        if rounded is None:
            raise ValueError(f"{what}: size must be a non-negative number, got {value}")
        return rounded
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m and m.group(2).lower() in _UNITS:
            try:
                number = float(m.group(1))
            except ValueError:
                number = None
            if number is not None:
                rounded = _round_bytes(number * _UNITS[m.group(2).lower()])
                if rounded is not None:
                    return rounded
        raise ValueError(
            f"{what}: cannot parse size {value!r}: use bytes (an int) or a number with a unit "
            f"K, M, G, T or P (powers of 1024), e.g. '512M' or '1G'"
        )
    raise ValueError(f"{what}: expected an int or a string like '1G', got {type(value).__name__}")


def resolve_endpoint(endpoint: Optional[str]) -> Tuple[str, str]:
    """Returns (endpoint, grpc target) for an endpoint, ``$PBOX_ENDPOINT`` or the default."""
    ep = endpoint or os.environ.get("PBOX_ENDPOINT") or default_endpoint()
    if ep.startswith("unix://"):
        path = ep[len("unix://"):]
        if not path.startswith("/"):
            raise ValueError(f"endpoint {ep!r}: use unix:///absolute/path.sock")
        return ep, "unix://" + path
    if ep.startswith("tcp://"):
        hostport = ep[len("tcp://"):].rstrip("/")
        if ":" not in hostport or not hostport.rsplit(":", 1)[1].isdigit():
            raise ValueError(f"endpoint {ep!r}: use tcp://HOST:PORT")
        return ep, hostport
    if ep.startswith("/"):
        return "unix://" + ep, "unix://" + ep
    raise ValueError(
        f"endpoint {ep!r}: expected unix:///path/to/pbox.sock or tcp://HOST:PORT"
    )


def tcp_host(endpoint: str, target: str) -> str:
    """The host a client reached the agent at, for the agent's ``tcp://:PORT`` data endpoints
    ("" for a unix endpoint)."""
    if not endpoint.startswith("tcp://"):
        return ""
    return target.rsplit(":", 1)[0]


def resolve_token(token: Optional[str]) -> Optional[str]:
    """The token from the argument, ``$PBOX_TOKEN`` or the file named by ``$PBOX_TOKEN_FILE``."""
    if token:
        return token.strip()
    env = os.environ.get("PBOX_TOKEN")
    if env:
        return env.strip()
    path = os.environ.get("PBOX_TOKEN_FILE")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            raise ValueError(f"PBOX_TOKEN_FILE={path}: cannot read the token: {e}") from e
    return None


def metadata_for(token: Optional[str]) -> Tuple[Tuple[str, str], ...]:
    """Metadata of every call of one client object: its token, and the id the agent's
    per-client limits know it by (docs/pbox.md "Admission")."""
    client_id = f"py-{os.getpid()}-{os.urandom(6).hex()}"
    md: Tuple[Tuple[str, str], ...] = (("x-pbox-client", client_id),)
    return md + ((("authorization", f"Bearer {token}"),) if token else ())


def channel_options() -> List[Tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 10000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def _str_map(value: Optional[Mapping[str, Any]], what: str) -> Dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what}: expected a dict of str to str, got {type(value).__name__}")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"{what}: keys must be non-empty strings, got {k!r}")
        out[k] = str(v)
    return out


def build_spec(
    image: str = "host",
    cpus: int = 1,
    memory: Size = None,
    disk: Size = None,
    pids: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    workdir: Optional[str] = None,
    idle_ttl: Optional[float] = None,
    labels: Optional[Mapping[str, str]] = None,
    runtime: Optional[str] = None,
    cpu_quota: Optional[float] = None,
) -> pb.SandboxSpec:
    """A validated ``SandboxSpec`` message; raises ValueError with a clear message."""
    if not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 0:
        raise ValueError(f"cpus: expected a non-negative int, got {cpus!r}")
    if pids is not None and (not isinstance(pids, int) or isinstance(pids, bool) or pids < 0):
        raise ValueError(f"pids: expected a non-negative int, got {pids!r}")
    if idle_ttl is not None and (isinstance(idle_ttl, bool) or idle_ttl < 0):
        raise ValueError(f"idle_ttl: expected seconds >= 0, got {idle_ttl!r}")
    if cpu_quota is not None and (isinstance(cpu_quota, bool) or cpu_quota < 0):
        raise ValueError(f"cpu_quota: expected CPUs >= 0 (e.g. 0.5), got {cpu_quota!r}")
    return pb.SandboxSpec(
        image=image or "",
        runtime=runtime or "",
        cpus=cpus,
        cpu_quota=float(cpu_quota or 0.0),
        memory_bytes=parse_size(memory, "memory"),
        pids=pids or 0,
        disk_bytes=parse_size(disk, "disk"),
        env=_str_map(env, "env"),
        workdir=workdir or "",
        idle_ttl_seconds=int(idle_ttl or 0),
        labels=_str_map(labels, "labels"),
    )


def clone_request(
    sandbox_id: str,
    n: int,
    cpus: Optional[int] = None,
    memory: Size = None,
    disk: Size = None,
    pids: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    workdir: Optional[str] = None,
    idle_ttl: Optional[float] = None,
    labels: Optional[Mapping[str, str]] = None,
    cpu_quota: Optional[float] = None,
) -> pb.CloneSandboxRequest:
    """A ``CloneSandboxRequest``: ``None`` keeps the source's value; ``env`` and ``labels``
    merge over the source's. Raises ValueError for a bad ``n`` or override."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n: expected an int >= 1, got {n!r}")
    overrides = build_spec("", cpus or 0, memory, disk, pids, env, workdir, idle_ttl, labels,
                           None, cpu_quota)
    # The clones join the source's session (the agent's default for an empty session id).
    return pb.CloneSandboxRequest(sandbox_id=sandbox_id, count=n, overrides=overrides)


def cpu_list_text(cpus: Union[str, Sequence[int]]) -> str:
    """A session's CPU set as the agent takes it: a CPU list ("4-7,12") as given, or CPU
    numbers joined with commas (the agent checks both)."""
    if isinstance(cpus, str):
        return cpus
    out = []
    for cpu in cpus:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
            raise ValueError(f"cpuset: {cpu!r} is not a CPU number")
        out.append(str(cpu))
    return ",".join(out)


def normalize_argv(argv: Argv) -> List[str]:
    """A str becomes ``["sh", "-c", str]``; a sequence must be non-empty strings."""
    if isinstance(argv, str):
        return ["sh", "-c", argv]
    if isinstance(argv, (bytes, bytearray)):
        raise ValueError("argv: expected a str or a list of str, got bytes")
    out = list(argv)
    if not out:
        raise ValueError("argv: empty command")
    for a in out:
        if not isinstance(a, str):
            raise ValueError(f"argv: every argument must be a str, got {a!r}")
    return out


def to_bytes(data: Union[bytes, bytearray, memoryview, str, None]) -> bytes:
    if data is None:
        return b""
    if isinstance(data, str):
        return data.encode("utf-8")
    return bytes(data)


def timeout_ms(timeout: Optional[float]) -> int:
    if timeout is None:
        return 0
    if isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
    return max(1, int(round(timeout * 1000)))


def iter_chunks(data: Any) -> Iterator[bytes]:
    """Chunks of at most CHUNK_BYTES from bytes/str/bytearray/memoryview or a binary file."""
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        view = memoryview(to_bytes(data) if isinstance(data, str) else data).cast("B")
        for i in range(0, len(view), CHUNK_BYTES):
            yield bytes(view[i:i + CHUNK_BYTES])
        return
    read = getattr(data, "read", None)
    if read is None:
        raise ValueError(
            f"data: expected bytes, str or a binary file object, got {type(data).__name__}"
        )
    while True:
        chunk = read(CHUNK_BYTES)
        if not chunk:
            return
        if isinstance(chunk, str):
            chunk = chunk.encode("utf-8")
        yield bytes(chunk)


def write_requests(sandbox_id: str, path: str, data: Any, mode: int, make_parents: bool,
                   append: bool) -> Iterator[pb.WriteFileRequest]:
    yield pb.WriteFileRequest(
        header=pb.WriteFileHeader(
            sandbox_id=sandbox_id, path=path, mode=mode, make_parents=make_parents, append=append
        )
    )
    for chunk in iter_chunks(data):
        yield pb.WriteFileRequest(chunk=chunk)


def check_mode(mode: int) -> int:
    if not isinstance(mode, int) or isinstance(mode, bool) or mode < 0 or mode > 0o7777:
        raise ValueError(f"mode: expected permission bits such as 0o644, got {mode!r}")
    return mode


def file_info(m: pb.FileInfo) -> FileInfo:
    try:
        kind = FileType(m.type)
    except ValueError:
        kind = FileType.UNKNOWN
    return FileInfo(
        path=m.path,
        type=kind,
        size=m.size,
        mode=m.mode,
        mtime_unix_ns=m.mtime_unix_ns,
        symlink_target=m.symlink_target,
    )


_STATES = {
    pb.SANDBOX_STATE_UNSPECIFIED: "unspecified",
    pb.SANDBOX_STATE_RUNNING: "running",
    pb.SANDBOX_STATE_DESTROYING: "destroying",
}


def sandbox_info(m: pb.Sandbox) -> SandboxInfo:
    s = m.spec
    return SandboxInfo(
        id=m.id,
        session_id=m.session_id,
        spec=SandboxSpec(
            image=s.image,
            runtime=s.runtime,
            cpus=s.cpus,
            cpu_quota=s.cpu_quota,
            memory_bytes=s.memory_bytes,
            pids=s.pids,
            disk_bytes=s.disk_bytes,
            env=dict(s.env),
            workdir=s.workdir,
            idle_ttl_seconds=s.idle_ttl_seconds,
            labels=dict(s.labels),
        ),
        state=_STATES.get(m.state, "unspecified"),
        cpuset=m.cpuset,
        created_unix_ms=m.created_unix_ms,
        last_used_unix_ms=m.last_used_unix_ms,
        running_execs=m.running_execs,
        memory_usage_bytes=m.memory_usage_bytes,
    )


def agent_info(m: pb.InfoResponse) -> AgentInfo:
    return AgentInfo(
        version=m.version,
        default_runtime=m.default_runtime,
        runtimes=list(m.runtimes),
        cpuset=m.cpuset,
        max_sandboxes=m.max_sandboxes,
        live_sandboxes=m.live_sandboxes,
        images=list(m.images),
        hostname=m.hostname,
        cgroup_version=m.cgroup_version,
        default_memory_bytes=m.default_memory_bytes,
        default_disk_bytes=m.default_disk_bytes,
        default_pids=m.default_pids,
        mode=m.mode,
        limits=list(m.limits),
        uid=m.uid,
        root_fs=m.root_fs or "overlayfs",
    )


def health(m: pb.HealthResponse) -> Health:
    return Health(serving=m.serving, live_sandboxes=m.live_sandboxes)


def run_result(r: pb.ExecResult, stdout: bytes = b"", stderr: bytes = b"",
               argv: Optional[List[str]] = None) -> RunResult:
    return RunResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=r.exit_code,
        signal=r.signal,
        timed_out=r.timed_out,
        oom_killed=r.oom_killed,
        stdout_truncated=r.stdout_truncated,
        stderr_truncated=r.stderr_truncated,
        stdout_bytes=r.stdout_bytes,
        stderr_bytes=r.stderr_bytes,
        wall_time_ms=r.wall_time_ms,
        cpu_time_ms=r.cpu_time_ms,
        peak_memory_bytes=r.peak_memory_bytes,
        error=r.error,
        argv=list(argv or []),
    )


def run_request(sandbox_id: str, argv: Argv, env: Optional[Mapping[str, str]], cwd: Optional[str],
                timeout: Optional[float], stdin: Union[bytes, str, None],
                max_output: Size) -> Tuple[pb.RunRequest, List[str]]:
    args = normalize_argv(argv)
    req = pb.RunRequest(
        sandbox_id=sandbox_id,
        argv=args,
        env=_str_map(env, "env"),
        cwd=cwd or "",
        timeout_ms=timeout_ms(timeout),
        stdin=to_bytes(stdin),
        max_output_bytes=parse_size(max_output, "max_output"),
    )
    return req, args


def exec_start(sandbox_id: str, argv: Argv, env: Optional[Mapping[str, str]], cwd: Optional[str],
               timeout: Optional[float], stdin: bool) -> Tuple[pb.ExecRequest, List[str]]:
    args = normalize_argv(argv)
    req = pb.ExecRequest(
        start=pb.ExecStart(
            sandbox_id=sandbox_id,
            argv=args,
            env=_str_map(env, "env"),
            cwd=cwd or "",
            timeout_ms=timeout_ms(timeout),
            stdin=stdin,
        )
    )
    return req, args
