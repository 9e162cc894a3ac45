"""pbox: sandboxes on the spare CPUs of a job's GPU nodes, from Python.

Quick start::

    import pbox

    client = pbox.Client()                      # $PBOX_ENDPOINT or unix:///run/pbox/pbox.sock
    with client.session(client_name="rollouts") as session:   # a lease: closing it (or the
        sb = session.create(memory="512M", disk="1G")          # process dying) destroys its
        sb.write_file("/tmp/x.py", "print(6 * 7)")             # sandboxes
        r = sb.run(["python3", "/tmp/x.py"], timeout=10)
        print(r.exit_code, r.stdout)           # 0 b'42\\n'
        r.check()                              # raises pbox.CommandError unless r.ok

        with sb.exec(["cat"], stdin=True) as p:     # streaming, back-pressured
            p.write_stdin(b"hi")
            p.close_stdin()
            for stream, data in p:
                print(stream, data)
        print(p.result.exit_code)

Over TCP: ``pbox.Client("tcp://node7:7070", token=...)`` (or ``$PBOX_TOKEN`` /
``$PBOX_TOKEN_FILE``). asyncio: :mod:`pbox.aio` has the same surface with ``await``.

Errors are :class:`PboxError` subclasses named after the agent's status code
(:class:`NotFound`, :class:`ResourceExhausted`, :class:`Unauthenticated`...), carrying the
agent's message. Bad arguments (e.g. ``memory="lots"``) raise ``ValueError`` before any call.
"""

from .client import Client, ExecProcess, Sandbox, Session
from .errors import (Aborted, AlreadyExists, Cancelled, CommandError, DataLoss, DeadlineExceeded,
                     FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
                     PboxError, PermissionDenied, ResourceExhausted, SessionClosed,
                     Unauthenticated, Unavailable, Unimplemented, Unknown)
from .images import ImageInfo, PruneResult
from .types import AgentInfo, FileInfo, FileType, Health, RunResult, SandboxInfo, SandboxSpec
from ._common import parse_size
from .cluster import ClusterClient, ClusterSession, CpuSplit, cpu_split, load_endpoints, parse_cpu_list  # noqa: E501

__version__ = "0.1.0"

__all__ = [
    "Client", "Session", "Sandbox", "ExecProcess",
    "RunResult", "FileInfo", "FileType", "SandboxInfo", "SandboxSpec", "AgentInfo", "Health",
    "PboxError", "CommandError", "SessionClosed", "Cancelled", "Unknown", "InvalidArgument",
    "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied", "ResourceExhausted",
    "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented", "Internal", "Unavailable",
    "DataLoss", "Unauthenticated", "parse_size",
]
