"""pbox across the nodes of a job: the endpoints file, the CPU split, and a client that places
sandboxes on several agents.

Inside a Slurm job started with ``deploy/slurm/pbox-slurm start``::

    import pbox

    split = pbox.cpu_split()                 # this node's CPUs: trainer vs. sandboxes
    os.sched_setaffinity(0, pbox.parse_cpu_list(split.trainer))

    with pbox.ClusterClient() as cluster:    # $PBOX_ENDPOINTS: the endpoints file or a list
        with cluster.session(client_name="rollouts") as s:   # one lease on every node
            sb = s.create(memory="1G")                     # least-loaded node
            near = s.create(node="gpu-node-3")             # beside one rollout worker
            print(sb.node, sb.run("nproc").stdout)

Endpoints file (written by the launcher; JSON)::

    {"job_id": "123", "token_file": "/shared/.pbox-slurm-123/token",
     "nodes": [{"node": "n1", "host": "10.0.0.1", "port": 40123,
                "endpoint": "tcp://10.0.0.1:40123", "cpuset": "56-63",
                "trainer_cpus": "0-55", "job_cpus": "0-63",
                "token_file": "/shared/.pbox-slurm-123/token"}, ...]}

Only ``nodes[].endpoint`` (or ``host`` and ``port``) is required; ``token_file`` may be given per
node or once at the top. ``$PBOX_ENDPOINTS`` is either the path of such a file or a
comma-separated list of ``tcp://HOST:PORT`` / ``unix:///path`` endpoints.

Thread-safety: :class:`ClusterClient` and :class:`ClusterSession` may be used from many threads.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from . import _common as c
from .client import Client, Sandbox, Session
from .errors import PboxError, ResourceExhausted, Unavailable
from .types import Health, SandboxInfo

__all__ = ["Endpoint", "CpuSplit", "ClusterClient", "ClusterSession", "load_endpoints",
           "cpu_split", "parse_cpu_list", "format_cpu_list"]

ENDPOINTS_ENV = "PBOX_ENDPOINTS"
SANDBOX_CPUS_ENV = "PBOX_SANDBOX_CPUS"


# ---- CPU lists ----

def parse_cpu_list(text: str) -> List[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (sorted, unique).

    Raises ValueError on anything else (empty, negative, reversed ranges, junk)."""
    if not isinstance(text, str):
        raise ValueError(f"CPU list must be a string, got {type(text).__name__}")
    s = text.strip()
    if not s:
        raise ValueError("empty CPU list")
    cpus = set()
    for part in s.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: {part!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b > 65535:
            raise ValueError(f"bad CPU list {text!r}: range {part!r}")
        cpus.update(range(a, b + 1))
    return sorted(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``. Raises ValueError if empty or negative."""
    xs = sorted(set(int(x) for x in cpus))
    if not xs or xs[0] < 0:
        raise ValueError("empty or negative CPU list")
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


@dataclass(frozen=True)
class CpuSplit:
    """One node's CPUs: ``trainer`` for training/inference, ``sandbox`` for the pbox agent
    (CPU lists as text, e.g. ``"0-55"`` and ``"56-63"``); disjoint, never empty."""
    trainer: str
    sandbox: str
    node: str = ""

    def role(self, role: str) -> str:
        if role == "trainer":
            return self.trainer
        if role == "sandbox":
            return self.sandbox
        raise ValueError(f"role must be 'trainer' or 'sandbox', not {role!r}")


def split_cpus(available: Union[str, Sequence[int]], sandbox_cpus: Union[int, str]) -> CpuSplit:
    """Splits ``available`` CPUs: an int N takes the LAST N for sandboxes; a CPU list names them
    (it must lie within ``available``). At least one CPU stays on each side.

    Raises ValueError otherwise."""
    avail = parse_cpu_list(available) if isinstance(available, str) else sorted(set(available))
    if not avail:
        raise ValueError("no CPUs available")
    if isinstance(sandbox_cpus, str) and sandbox_cpus.strip().isdigit():
        sandbox_cpus = int(sandbox_cpus.strip())
    if isinstance(sandbox_cpus, bool):
        raise ValueError("sandbox_cpus must be a count or a CPU list")
    if isinstance(sandbox_cpus, int):
        n = sandbox_cpus
        if n < 1 or n >= len(avail):
            raise ValueError(f"sandbox_cpus={n}: need 1..{len(avail) - 1} of the "
                             f"{len(avail)} CPUs {format_cpu_list(avail)}")
        sand = avail[-n:]
    else:
        sand = parse_cpu_list(sandbox_cpus)
        outside = sorted(set(sand) - set(avail))
        if outside:
            raise ValueError(f"sandbox CPUs {format_cpu_list(outside)} are not among the job's "
                             f"CPUs {format_cpu_list(avail)}")
        if len(sand) >= len(avail):
            raise ValueError("sandbox CPUs would leave no CPU to the trainer")
    trainer = [x for x in avail if x not in set(sand)]
    return CpuSplit(trainer=format_cpu_list(trainer), sandbox=format_cpu_list(sand))


def _node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def cpu_split(sandbox_cpus: Union[int, str, None] = None, *,
              available: Union[str, Sequence[int], None] = None,
              endpoints_file: Optional[str] = None, node: Optional[str] = None) -> CpuSplit:
    """This node's CPU split.

    If the endpoints file (``endpoints_file``, else ``$PBOX_ENDPOINTS`` when it names a file)
    has an entry for this node (``node``, else ``$SLURMD_NODENAME`` or the short hostname) with
    ``cpuset`` and ``trainer_cpus``, that is the answer: what the agent really uses. Otherwise
    the split is computed from ``available`` (default: this process's CPU affinity) and
    ``sandbox_cpus`` (default ``$PBOX_SANDBOX_CPUS``): a count takes the last N CPUs, a list
    names them.

    Raises ValueError if neither source gives an answer or the numbers do not fit.
    """
    node = node or _node_name()
    path = endpoints_file
    if path is None:
        env = os.environ.get(ENDPOINTS_ENV, "")
        if env and "://" not in env:
            path = env
    if path and sandbox_cpus is None and available is None:
        for ep in load_endpoints(path):
            if ep.node == node and ep.cpuset and ep.trainer_cpus:
                return CpuSplit(trainer=ep.trainer_cpus, sandbox=ep.cpuset, node=node)
    if sandbox_cpus is None:
        sandbox_cpus = os.environ.get(SANDBOX_CPUS_ENV)
        if not sandbox_cpus:
            raise ValueError(f"no entry for node {node!r} in the endpoints file and no "
                             f"sandbox_cpus (or ${SANDBOX_CPUS_ENV}) given")
    if available is None:
        available = sorted(os.sched_getaffinity(0))
    s = split_cpus(available, sandbox_cpus)
    return CpuSplit(trainer=s.trainer, sandbox=s.sandbox, node=node)


# ---- endpoints ----

@dataclass(frozen=True)
class Endpoint:
    """One agent of the cluster."""
    node: str
    endpoint: str
    token_file: str = ""
    cpuset: str = ""
    trainer_cpus: str = ""
    extra: Dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _endpoints_from_json(doc: Any, where: str) -> List[Endpoint]:
    if isinstance(doc, list):
        doc = {"nodes": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list) or not doc["nodes"]:
        raise ValueError(f"{where}: expected an object with a non-empty 'nodes' list")
    top_token = doc.get("token_file", "")
    if not isinstance(top_token, str):
        raise ValueError(f"{where}: token_file must be a string")
    out: List[Endpoint] = []
    for i, n in enumerate(doc["nodes"]):
        if not isinstance(n, dict):
            raise ValueError(f"{where}: nodes[{i}] is not an object")
        ep = n.get("endpoint")
        if not ep:
            host, port = n.get("host"), n.get("port")
            if not isinstance(host, str) or not host or isinstance(port, bool) or \
                    not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(f"{where}: nodes[{i}] needs 'endpoint' or 'host' and 'port'")
            ep = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        if not isinstance(ep, str):
            raise ValueError(f"{where}: nodes[{i}].endpoint must be a string")
        c.resolve_endpoint(ep)  # validates
        name = n.get("node") or n.get("host") or ep
        for key in ("cpuset", "trainer_cpus", "token_file"):
            if key in n and not isinstance(n[key], str):
                raise ValueError(f"{where}: nodes[{i}].{key} must be a string")
        if n.get("cpuset"):
            parse_cpu_list(n["cpuset"])
        out.append(Endpoint(node=str(name), endpoint=ep,
                            token_file=n.get("token_file") or top_token,
                            cpuset=n.get("cpuset", ""), trainer_cpus=n.get("trainer_cpus", ""),
                            extra=dict(n)))
    names = [e.node for e in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: duplicate node names {names}")
    return out


def load_endpoints(spec: Union[str, Sequence[str], None] = None) -> List[Endpoint]:
    """Endpoints from a list of endpoint strings, a comma-separated string of them, the path of
    an endpoints file, or (``spec`` None) ``$PBOX_ENDPOINTS``.

    Raises ValueError for a missing, unreadable or malformed source."""
    if spec is None:
        spec = os.environ.get(ENDPOINTS_ENV, "")
        if not spec:
            raise ValueError(f"no endpoints: pass endpoints= or endpoints_file=, or set "
                             f"${ENDPOINTS_ENV}")
    if isinstance(spec, str) and "://" not in spec:
        try:
            with open(spec, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as e:
            raise ValueError(f"endpoints file {spec}: {e.strerror or e}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"endpoints file {spec}: not JSON: {e}") from e
        return _endpoints_from_json(doc, f"endpoints file {spec}")
    items = [x.strip() for x in spec.split(",")] if isinstance(spec, str) else list(spec)
    items = [x for x in items if x]
    if not items:
        raise ValueError("empty endpoint list")
    out = []
    for ep in items:
        if not isinstance(ep, str):
            raise ValueError(f"endpoint {ep!r} is not a string")
        canonical, _ = c.resolve_endpoint(ep)
        out.append(Endpoint(node=canonical, endpoint=canonical))
    if len({e.node for e in out}) != len(out):
        raise ValueError(f"duplicate endpoints in {items}")
    return out


# ---- the client ----

def _read_token(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as e:
        raise ValueError(f"token file {path}: {e.strerror or e}") from e


class _Node:
    def __init__(self, ep: Endpoint, client: Client, weight: int) -> None:
        self.ep = ep
        self.client = client
        self.weight = max(1, weight)  # sandbox CPUs: load is sandboxes per CPU
        self.live = 0                 # from the last Health
        self.added = 0                # created by us since then
        self.refreshed = 0.0          # monotonic time of the last Health; 0: never
        self.down_until = 0.0         # skip for placement until then (it did not answer)


class ClusterClient:
    """Clients of several pboxd agents (one per node) behind one object.

    Args:
        endpoints: a list of ``tcp://HOST:PORT`` / ``unix:///path`` strings, or a
            comma-separated string of them.
        endpoints_file: the launcher's endpoints file (JSON; see the module doc).
            With neither, ``$PBOX_ENDPOINTS`` is used (a file path or a list).
        token: bearer token for every node; default: each node's ``token_file`` from the
            endpoints file, else ``$PBOX_TOKEN`` / ``$PBOX_TOKEN_FILE``.
        timeout: deadline in seconds of control calls, as in :class:`pbox.Client`.
        refresh: seconds a node's Health (its live sandbox count) is trusted for placement.
        data_channel: as in :class:`pbox.Client` (file bytes on each agent's data channel).

    Placement: :meth:`ClusterSession.create` (and :meth:`create`) put a sandbox on the named
    ``node``, else on the node with the fewest sandboxes per sandbox CPU (counting both the
    agents' reports and this client's own creations since; ties go to the earlier node). A node
    that does not answer (Unavailable), or is full (ResourceExhausted), is passed over for the
    next one; any other error (e.g. Unauthenticated) is raised.

    Owns one :class:`pbox.Client` per node; ``close()`` closes them all (and their sessions).
    Raises ValueError on a bad endpoint list or token file.
    """

    def __init__(self, endpoints: Union[str, Sequence[str], None] = None, *,
                 endpoints_file: Optional[str] = None, token: Optional[str] = None,
                 timeout: Optional[float] = None, refresh: float = 1.0,
                 data_channel: bool = True) -> None:
        if endpoints is not None and endpoints_file is not None:
            raise ValueError("pass endpoints or endpoints_file, not both")
        eps = load_endpoints(endpoints_file if endpoints_file is not None else endpoints)
        self._refresh = refresh
        self._lock = threading.Lock()
        self._nodes: Dict[str, _Node] = {}
        try:
            for ep in eps:
                tok = token or (_read_token(ep.token_file) if ep.token_file else None)
                weight = len(parse_cpu_list(ep.cpuset)) if ep.cpuset else 1
                client = Client(ep.endpoint, tok, timeout=timeout, data_channel=data_channel)
                self._nodes[ep.node] = _Node(ep, client, weight)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=min(32, max(1, len(self._nodes))),
                                        thread_name_prefix="pbox-cluster")

    # ---- nodes ----

    @property
    def nodes(self) -> List[str]:
        """Node names, in endpoint order."""
        return list(self._nodes)

    def endpoint(self, node: str) -> Endpoint:
        return self._node(node).ep

    def client(self, node: str) -> Client:
        """The :class:`pbox.Client` of one node (owned by this object)."""
        return self._node(node).client

    def _node(self, node: str) -> _Node:
        try:
            return self._nodes[node]
        except KeyError:
            raise ValueError(f"unknown node {node!r}; nodes: {', '.join(self._nodes)}") from None

    def _each(self, fn, nodes: Optional[Iterable[str]] = None) -> Dict[str, Any]:
        """Runs fn(node) on every node in parallel; returns {node: result or exception}."""
        names = list(nodes) if nodes is not None else list(self._nodes)
        futs = {n: self._pool.submit(fn, self._nodes[n]) for n in names}
        out: Dict[str, Any] = {}
        for n, f in futs.items():
            try:
                out[n] = f.result()
            except Exception as e:  # noqa: BLE001 - returned to the caller per node
                out[n] = e
        return out

    def health(self) -> Dict[str, Union[Health, PboxError]]:
        """Each node's Health, or the error that asking it raised."""
        res = self._each(lambda n: n.client.health())
        now = time.monotonic()
        with self._lock:
            for name, h in res.items():
                node = self._nodes[name]
                if isinstance(h, Health):
                    node.live, node.added, node.refreshed, node.down_until = \
                        h.live_sandboxes, 0, now, 0.0
        return res

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Returns once every node serves; raises Unavailable after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            res = self.health()
            bad = {n: h for n, h in res.items() if not (isinstance(h, Health) and h.serving)}
            if not bad:
                return
            if time.monotonic() > deadline:
                raise Unavailable(f"nodes not healthy after {timeout:.0f} s: "
                                  + "; ".join(f"{n}: {h}" for n, h in bad.items()))
            time.sleep(0.2)

    def list(self, node: Optional[str] = None) -> Dict[str, List[SandboxInfo]]:
        """The sandboxes of every node (or one): {node: [SandboxInfo]}. Raises the first
        node's error if any node fails."""
        res = self._each(lambda n: n.client.list(), [node] if node else None)
        for v in res.values():
            if isinstance(v, Exception):
                raise v
        return res

    # ---- placement ----

    def _order(self) -> List[_Node]:
        """Nodes, least loaded first, refreshing stale Health first."""
        now = time.monotonic()
        stale = [n.ep.node for n in self._nodes.values()
                 if now - n.refreshed > self._refresh and n.down_until <= now]
        if stale:
            res = self._each(lambda n: n.client.health(), stale)
            for h in res.values():
                if isinstance(h, Exception) and not isinstance(h, Unavailable):
                    raise h  # misconfigured (e.g. Unauthenticated): say so, do not skip
            with self._lock:
                for name, h in res.items():
                    node = self._nodes[name]
                    if isinstance(h, Health) and h.serving:
                        node.live, node.added, node.refreshed = h.live_sandboxes, 0, now
                    else:
                        node.down_until = now + self._refresh
        with self._lock:
            up = [n for n in self._nodes.values() if n.down_until <= now]
            idx = {n.ep.node: i for i, n in enumerate(self._nodes.values())}
            return sorted(up, key=lambda n: ((n.live + n.added) / n.weight, idx[n.ep.node]))

    def _place(self, create, node: Optional[str]) -> Sandbox:
        if node is not None:
            n = self._node(node)
            sb = create(n)
            with self._lock:
                n.added += 1
            sb.node = n.ep.node
            return sb
        errors: List[str] = []
        for n in self._order():
            with self._lock:
                n.added += 1  # reserve before the call so concurrent creates spread
            try:
                sb = create(n)
            except (ResourceExhausted, Unavailable) as e:
                with self._lock:
                    n.added -= 1
                    if isinstance(e, Unavailable):
                        n.down_until = time.monotonic() + self._refresh
                errors.append(f"{n.ep.node}: {e}")
                continue
            except BaseException:
                with self._lock:
                    n.added -= 1
                raise
            sb.node = n.ep.node
            return sb
        if not errors:
            raise Unavailable("no node of the cluster answers Health", method="CreateSandbox")
        raise ResourceExhausted("no node could take the sandbox: " + "; ".join(errors),
                                method="CreateSandbox")

    def create(self, node: Optional[str] = None, **spec: Any) -> Sandbox:
        """A detached sandbox (see :meth:`pbox.Client.create`) on ``node`` or the least-loaded
        node. The returned Sandbox has a ``node`` attribute."""
        return self._place(lambda n: n.client.create(**spec), node)

    def session(self, client_name: str = "", job_id: str = "",
                ping_interval: Optional[float] = None,
                open_timeout: float = 30.0) -> "ClusterSession":
        """Opens one session on every node (a lease spanning the cluster); see
        :class:`ClusterSession`. Raises the first node's error if any node fails to open (the
        sessions already opened are closed)."""
        return ClusterSession(self, client_name, job_id, ping_interval, open_timeout)

    def close(self) -> None:
        """Closes every node's client: their sessions end and their sandboxes are destroyed."""
        for n in list(getattr(self, "_nodes", {}).values()):
            n.client.close()
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    def __enter__(self) -> "ClusterClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ClusterSession:
    """A session on every node of a :class:`ClusterClient`: sandboxes created through it are
    destroyed when it closes, or when this process dies (each agent sees its stream close)."""

    def __init__(self, cluster: ClusterClient, client_name: str, job_id: str,
                 ping_interval: Optional[float], open_timeout: float) -> None:
        self._cluster = cluster
        self.sessions: Dict[str, Session] = {}
        res = cluster._each(lambda n: n.client.session(client_name, job_id, ping_interval,
                                                        open_timeout))
        errors = [(n, e) for n, e in res.items() if isinstance(e, Exception)]
        self.sessions = {n: s for n, s in res.items() if isinstance(s, Session)}
        if errors:
            self.close()
            raise errors[0][1]

    @property
    def ids(self) -> Dict[str, str]:
        """{node: session id}."""
        return {n: s.id for n, s in self.sessions.items()}

    @property
    def closed(self) -> bool:
        return any(s.closed for s in self.sessions.values())

    def create(self, node: Optional[str] = None, **spec: Any) -> Sandbox:
        """A sandbox owned by this session (arguments as :meth:`pbox.Session.create`) on
        ``node`` or the least-loaded node; it has a ``node`` attribute. Raises ValueError for an
        unknown node, SessionClosed if that node's session ended, ResourceExhausted if no node
        could take it."""
        return self._cluster._place(lambda n: self.sessions[n.ep.node].create(**spec), node)

    def list(self) -> Dict[str, List[SandboxInfo]]:
        """{node: live sandboxes of this session there}."""
        return {n: s.list() for n, s in self.sessions.items()}

    def close(self, timeout: float = 30.0) -> None:
        """Closes every node's session; returns once each agent destroyed its sandboxes."""
        futs = [self._cluster._pool.submit(s.close, timeout) for s in self.sessions.values()]
        for f in futs:
            f.result()

    def __enter__(self) -> "ClusterSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
