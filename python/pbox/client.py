"""The blocking pbox client: :class:`Client`, :class:`Session`, :class:`Sandbox`,
:class:`ExecProcess`.

Thread-safety: a :class:`Client` (and the :class:`Sandbox` objects it returns) may be used from
many threads at once; one gRPC channel is shared. An :class:`ExecProcess` belongs to the thread
that reads its output, though ``write_stdin``/``signal`` may be called from another thread.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from typing import IO, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from . import _common as c
from . import _data
from . import _shared
from ._proto import pbox_pb2 as pb
from ._proto import pbox_pb2_grpc as pb_grpc
from .errors import Internal, PboxError, SessionClosed, error_from_rpc, Unavailable, with_method
from .types import FileInfo, RunResult, SandboxInfo

__all__ = ["Client", "Session", "Sandbox", "ExecProcess"]

Data = Union[bytes, bytearray, memoryview, str, IO[bytes]]


class Client(_shared.blocking(_shared.ClientMethods, __name__, "Client")):
    """A connection to one pboxd.

    Args:
        endpoint: ``"unix:///run/pbox/pbox.sock"`` (no token needed) or ``"tcp://HOST:PORT"``.
            Default: ``$PBOX_ENDPOINT``, else ``unix:///run/pbox/pbox.sock``, or for a user
            without a system agent that user's own (``$XDG_RUNTIME_DIR/pbox/pbox.sock``, else
            ``/tmp/pbox-UID/pbox.sock``: a rootless agent's default).
        token: bearer token for TCP endpoints. Default: ``$PBOX_TOKEN``, else the contents of
            the file named by ``$PBOX_TOKEN_FILE``.
        timeout: deadline in seconds for control calls (create, list, stat...); None waits
            as long as the agent takes. Commands and transfers are never given a deadline
            (use ``run(timeout=...)``).
        data_channel: move file bytes (``write_file``, ``upload``, ``read_file``,
            ``download``) on the agent's data channel (docs/pbox.md "Data channel"); False,
            or ``$PBOX_DATA_CHANNEL=0``, keeps them on the gRPC streams. The client falls back
            to the streams by itself for an agent without the channel, or when its data
            socket cannot be reached.

    The client owns a gRPC channel and a few pooled data connections; ``close()`` it (or use
    ``with``) when done. Closing the client closes its open sessions, which destroys their
    sandboxes.
    """

    def __init__(self, endpoint: Optional[str] = None, token: Optional[str] = None, *,
                 timeout: Optional[float] = None, data_channel: bool = True) -> None:
        self.endpoint, target = c.resolve_endpoint(endpoint)
        self._md = c.metadata_for(c.resolve_token(token))
        self._timeout = timeout
        self._channel = grpc.insecure_channel(target, options=c.channel_options())
        self._stub = pb_grpc.PboxStub(self._channel)
        self._data = _data.FallbackState(data_channel)
        self._pool = _data.DataPool(c.tcp_host(self.endpoint, target))
        self._sessions: List["Session"] = []
        self._lock = threading.Lock()

    # ---- plumbing ----

    def _error(self, err: grpc.RpcError, method: str) -> PboxError:
        e = error_from_rpc(err, method)
        if isinstance(e, Unavailable):
            return Unavailable(f"cannot reach pboxd at {self.endpoint}: {e.message}",
                               code=e.code, method=method)
        return e

    def _unary(self, method: str, request: Any, deadline: bool = True) -> Any:
        try:
            return getattr(self._stub, method)(
                request, metadata=self._md, timeout=self._timeout if deadline else None)
        except grpc.RpcError as e:
            raise self._error(e, method) from None

    # ---- data channel (docs/pbox.md "Data channel") ----

    def _open_transfer(self, req: pb.OpenTransferRequest, method: str) -> pb.OpenTransferResponse:
        try:
            resp = self._stub.OpenTransfer(req, metadata=self._md, timeout=self._timeout)
        except grpc.RpcError as e:
            raise self._error(e, method) from None
        if len(resp.ticket) != _data.TICKET_BYTES:
            raise Internal(f"OpenTransfer: a ticket of {len(resp.ticket)} bytes, expected "
                           f"{_data.TICKET_BYTES}", method=method)
        return resp

    def _data_upload(self, sandbox_id: str, path: str, mode: int, make_parents: bool,
                     data: Any) -> Optional[FileInfo]:
        """Writes ``data`` on the data channel; None when the gRPC stream is to take it."""
        if self._data.off:
            return None
        src = _data.upload_source(data)
        if src is None:
            return None
        try:
            req = pb.OpenTransferRequest(
                sandbox_id=sandbox_id, path=path, direction=pb.TRANSFER_DIRECTION_UPLOAD,
                size=src.size, mode=mode, make_parents=make_parents)
            try:
                resp = self._open_transfer(req, "WriteFile")
            except PboxError as e:
                if self._data.fall_back(e, data_socket=False):
                    return None
                raise
            try:
                st = self._pool.upload(resp.data_endpoint, resp.ticket, src)
            except PboxError as e:
                if self._data.fall_back(e, data_socket=True):
                    return None
                raise with_method(e, "WriteFile") from None
        finally:
            src.close()
        src.sent()
        self._data.succeeded()
        return _data.file_info(path, st)

    def _data_download(self, sandbox_id: str, path: str, offset: int, length: int,
                       out: Any = None) -> Any:
        """The bytes of ``path`` (or their count, written to the file ``out``) from the data
        channel; None when the gRPC stream is to bring them (``out`` may then hold a part)."""
        if self._data.off:
            return None
        req = pb.OpenTransferRequest(
            sandbox_id=sandbox_id, path=path, direction=pb.TRANSFER_DIRECTION_DOWNLOAD,
            offset=offset, length=length)
        try:
            resp = self._open_transfer(req, "ReadFile")
        except PboxError as e:
            if self._data.fall_back(e, data_socket=False):
                return None
            raise
        try:
            if out is None:
                got = self._pool.download(resp.data_endpoint, resp.ticket)
            else:
                got = self._pool.download_to(resp.data_endpoint, resp.ticket, out)
        except PboxError as e:
            if self._data.fall_back(e, data_socket=True):
                return None
            raise with_method(e, "ReadFile") from None
        self._data.succeeded()
        return got

    # ---- info, health, images, sandboxes: _shared.ClientMethods ----

    def session(self, client_name: str = "", job_id: str = "",
                ping_interval: Optional[float] = None, open_timeout: float = 30.0,
                cpuset: Union[str, Sequence[int]] = "") -> "Session":
        """Opens a session (a lease): the sandboxes created through it are destroyed by the
        agent when the session closes, or within 1 s of this process dying.

        ``cpuset`` (a CPU list such as ``"4-7"``, or CPU numbers): the session's sandboxes run
        only on these CPUs, which must lie within the agent's sandbox CPUs; for a long-lived
        agent that several jobs share. Empty: the agent's whole set.

        Use it as a context manager; see :class:`Session`.
        """
        if not client_name:
            client_name = f"python:{os.getpid()}"
        if not job_id:
            job_id = os.environ.get("SLURM_JOB_ID", "")
        s = Session(self, client_name, job_id, ping_interval, open_timeout,
                    c.cpu_list_text(cpuset))
        with self._lock:
            self._sessions = [x for x in self._sessions if not x.closed]
            self._sessions.append(s)
        return s

    def close(self) -> None:
        """Closes the open sessions (destroying their sandboxes) and the channel."""
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for s in sessions:
            s.close()
        self._pool.close()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Session(_shared.blocking(_shared.SessionMethods, __name__, "Session")):
    """A lease held open on a background thread; made by :meth:`Client.session`.

    The stream is opened at construction (``id`` is known at once). Leaving the ``with`` block
    or calling ``close()`` half-closes the stream; the agent then destroys every sandbox of the
    session, and ``close()`` returns once it has. If the process dies the agent notices the
    broken stream and does the same.
    """

    def __init__(self, client: Client, client_name: str, job_id: str,
                 ping_interval: Optional[float], open_timeout: float, cpuset: str = "") -> None:
        self._client = client
        self._requests: "queue.Queue[Optional[pb.SessionRequest]]" = queue.Queue()
        self._requests.put(pb.SessionRequest(open=pb.SessionOpen(
            client_name=client_name, job_id=job_id, cpuset=cpuset)))
        self._opened = threading.Event()
        self._done = threading.Event()
        self._error: Optional[PboxError] = None
        self._id = ""
        self._nonce = itertools.count(1)
        self._pongs: Dict[int, threading.Event] = {}
        self._lock = threading.Lock()
        self._closing = False
        self._call = client._stub.Session(self._request_iter(), metadata=client._md)
        self._reader = threading.Thread(target=self._read, name="pbox-session", daemon=True)
        self._reader.start()
        if not self._opened.wait(open_timeout):
            self._call.cancel()
            raise Unavailable(f"pboxd at {client.endpoint} did not open a session within "
                              f"{open_timeout:.0f} s", method="Session")
        if self._error is not None:
            raise self._error
        self._pinger: Optional[threading.Thread] = None
        if ping_interval:
            self._pinger = threading.Thread(target=self._ping_loop, args=(ping_interval,),
                                            name="pbox-session-ping", daemon=True)
            self._pinger.start()

    def _request_iter(self) -> Iterator[pb.SessionRequest]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for ev in self._call:
                if ev.HasField("opened"):
                    self._id = ev.opened.session_id
                    self._opened.set()
                elif ev.HasField("pong"):
                    with self._lock:
                        waiter = self._pongs.pop(ev.pong.nonce, None)
                    if waiter is not None:
                        waiter.set()
        except grpc.RpcError as e:
            if not self._closing:
                self._error = self._client._error(e, "Session")
        finally:
            if self._error is None and not self._opened.is_set():
                self._error = SessionClosed("the agent ended the session before opening it",
                                            method="Session")
            self._requests.put(None)
            self._done.set()
            self._opened.set()
            with self._lock:
                for w in self._pongs.values():
                    w.set()

    def _ping_loop(self, interval: float) -> None:
        while not self._done.wait(interval):
            self._requests.put(pb.SessionRequest(ping=pb.Ping(nonce=next(self._nonce))))

    @property
    def id(self) -> str:
        """The session id the agent gave."""
        return self._id

    @property
    def closed(self) -> bool:
        return self._done.is_set()

    def _check_open(self) -> None:
        if self._done.is_set():
            reason = f": {self._error.message}" if self._error else ""
            raise SessionClosed(f"session {self._id} is closed{reason}")

    def ping(self, timeout: float = 10.0) -> float:
        """Round trip time in seconds of a Ping/Pong on the session stream.

        Raises SessionClosed if the stream ended, DeadlineExceeded-like PboxError on timeout.
        """
        self._check_open()
        nonce = next(self._nonce)
        waiter = threading.Event()
        with self._lock:
            self._pongs[nonce] = waiter
        t0 = time.monotonic()
        self._requests.put(pb.SessionRequest(ping=pb.Ping(nonce=nonce)))
        if not waiter.wait(timeout):
            raise PboxError(f"no pong within {timeout} s", method="Session")
        self._check_open()
        return time.monotonic() - t0

    def close(self, timeout: float = 30.0) -> None:
        """Ends the lease: the agent destroys the session's sandboxes before this returns
        (or ``timeout`` passes, after which the call is cancelled, which has the same effect)."""
        if self._closing:
            self._done.wait(timeout)
            return
        self._closing = True
        self._requests.put(None)
        if not self._done.wait(timeout):
            self._call.cancel()
            self._done.wait(5)
        if self._pinger is not None:
            self._pinger.join(timeout=5)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<pbox.Session {self._id}{' closed' if self.closed else ''}>"


class Sandbox(_shared.blocking(_shared.SandboxMethods, __name__, "Sandbox")):
    """One sandbox. Made by :meth:`Session.create`, :meth:`Client.create` or
    :meth:`Client.get`; as a context manager it destroys the sandbox on exit.

    Paths are inside the sandbox; the agent resolves them within the sandbox's root, so ``..``
    and symlinks cannot reach the host. File bytes move on the agent's data channel, or on the
    gRPC streams in 256 KiB chunks (see :meth:`write_file`).
    """

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def session_id(self) -> str:
        return self.info.session_id

    def __repr__(self) -> str:
        return f"<pbox.Sandbox {self.id}>"

    # ---- commands (run: _shared.SandboxMethods) ----

    def exec(self, argv: c.Argv, *, env: Optional[Mapping[str, str]] = None,
             cwd: Optional[str] = None, timeout: Optional[float] = None,
             stdin: Union[bool, bytes, str] = False) -> "ExecProcess":
        """Starts a command and streams its output; see :class:`ExecProcess`.

        Args as in :meth:`run`, except ``stdin``: False gives /dev/null, True an open pipe fed
        by ``write_stdin()``/``close_stdin()``, bytes or str are written and the pipe closed.
        """
        feed = None
        if not isinstance(stdin, bool):
            feed = c.to_bytes(stdin)
        req, args = c.exec_start(self.id, argv, env, cwd, timeout, stdin is not False)
        proc = ExecProcess(self._client, req, args)
        if feed is not None:
            proc._feed_in_background(feed)
        return proc

    # ---- files (read_text, listdir, stat, exists, mkdir, remove, move: _shared) ----

    def write_file(self, path: str, data: Data, mode: int = 0o644, make_parents: bool = True,
                   append: bool = False) -> FileInfo:
        """Writes bytes, a str (UTF-8) or a binary file object to ``path``. Returns the
        written file's info. Raises NotFound (missing parent and ``make_parents=False``),
        ResourceExhausted (disk full), PermissionDenied.

        A symlink at ``path`` is followed inside the sandbox; an existing file keeps its
        permission bits, a new one gets ``mode``. On the data channel (the default) the file
        is replaced atomically and a regular file object goes out with ``sendfile`` from its
        position (which then moves to its end); ``append``, and file objects that are neither
        regular files nor ``BytesIO``, are streamed on gRPC in 256 KiB chunks, written in
        place."""
        c.check_mode(mode)
        if not append:
            info = self._client._data_upload(self.id, path, mode, make_parents, data)
            if info is not None:
                return info
        reqs = c.write_requests(self.id, path, data, mode, make_parents, append)
        try:
            return c.file_info(self._client._stub.WriteFile(reqs, metadata=self._client._md))
        except grpc.RpcError as e:
            raise self._client._error(e, "WriteFile") from None

    def iter_read(self, path: str, offset: int = 0, length: int = 0) -> Iterator[bytes]:
        """Streams ``length`` bytes (0: to the end) of ``path`` from ``offset``, chunk by chunk,
        on the gRPC stream (:meth:`read_file` and :meth:`download` use the data channel)."""
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        call = self._client._stub.ReadFile(
            pb.ReadFileRequest(sandbox_id=self.id, path=path, offset=offset, length=length),
            metadata=self._client._md)
        try:
            for msg in call:
                yield msg.chunk
        except grpc.RpcError as e:
            raise self._client._error(e, "ReadFile") from None
        finally:
            call.cancel()

    def read_file(self, path: str, offset: int = 0, length: int = 0) -> bytes:
        """The contents of ``path`` (``length`` bytes from ``offset``; 0: to the end), on the
        data channel unless the client falls back to gRPC. Raises NotFound for a missing
        file."""
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        got = self._client._data_download(self.id, path, offset, length)
        if got is not None:
            return got
        return b"".join(self.iter_read(path, offset, length))

    def upload(self, local_path: Union[str, os.PathLike], remote_path: str,
               mode: Optional[int] = None, make_parents: bool = True) -> FileInfo:
        """Copies a local file into the sandbox, streaming; ``mode`` defaults to the local
        file's permission bits."""
        with open(local_path, "rb") as f:
            if mode is None:
                mode = os.fstat(f.fileno()).st_mode & 0o777
            return self.write_file(remote_path, f, mode=mode, make_parents=make_parents)

    def download(self, remote_path: str, local_path: Union[str, os.PathLike]) -> int:
        """Copies a sandbox file to ``local_path``, streaming to disk (nothing is buffered
        whole). Returns the number of bytes written. On error the partial file is removed."""
        n = 0
        tmp = f"{os.fspath(local_path)}.pbox-part"
        try:
            with open(tmp, "wb") as f:
                got = self._client._data_download(self.id, remote_path, 0, 0, f)
                if got is not None:
                    n = got
                else:
                    f.seek(0)
                    f.truncate()
                    for chunk in self.iter_read(remote_path):
                        f.write(chunk)
                        n += len(chunk)
            os.replace(tmp, local_path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return n

    # ---- lifetime (clone, destroy: _shared.SandboxMethods) ----

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy(missing_ok=True)


class ExecProcess:
    """A command started by :meth:`Sandbox.exec`, streaming its output as it comes.

    Iterate it for ``(stream, data)`` tuples, ``stream`` being ``"stdout"`` or ``"stderr"``;
    the iteration ends when the command has ended, and ``result`` then holds its
    :class:`RunResult` (with empty stdout/stderr). Output is back-pressured: the command is
    paused while nobody reads. Example::

        with sb.exec(["cat"], stdin=True) as p:
            p.write_stdin(b"hello")
            p.close_stdin()
            for stream, data in p:
                print(stream, data)
        print(p.result.exit_code)

    Leaving the ``with`` block kills a command that is still running.
    """

    def __init__(self, client: Client, start: pb.ExecRequest, argv: List[str]) -> None:
        self._client = client
        self.argv = argv
        self._q: "queue.Queue[Optional[pb.ExecRequest]]" = queue.Queue(maxsize=64)
        self._q.put(start)
        self._requests_done = threading.Event()
        self.result: Optional[RunResult] = None
        self._call = client._stub.Exec(self._request_iter(), metadata=client._md)
        self._responses = self._response_iter()
        self._feeder: Optional[threading.Thread] = None
        self._feed_error: Optional[BaseException] = None

    def _request_iter(self) -> Iterator[pb.ExecRequest]:
        while True:
            try:
                item = self._q.get(timeout=0.2)
            except queue.Empty:
                if self._requests_done.is_set():
                    return
                continue
            if item is None:
                return
            yield item

    def _end_requests(self) -> None:
        self._requests_done.set()
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass

    def _response_iter(self) -> Iterator[Tuple[str, bytes]]:
        try:
            for msg in self._call:
                kind = msg.WhichOneof("kind")
                if kind == "stdout":
                    yield "stdout", msg.stdout
                elif kind == "stderr":
                    yield "stderr", msg.stderr
                elif kind == "result":
                    self.result = c.run_result(msg.result, argv=self.argv)
                    # Half-close at once: the agent waits for it before ending the call.
                    self._end_requests()
        except grpc.RpcError as e:
            raise self._client._error(e, "Exec") from None
        finally:
            self._end_requests()
        if self.result is None:
            raise PboxError("the agent ended the command's stream without a result",
                            method="Exec")

    def __iter__(self) -> Iterator[Tuple[str, bytes]]:
        return self._responses

    def stdout_iter(self) -> Iterator[bytes]:
        """Yields stdout chunks only; stderr chunks are dropped."""
        for stream, data in self._responses:
            if stream == "stdout":
                yield data

    @property
    def done(self) -> bool:
        return self.result is not None

    def _put(self, req: pb.ExecRequest) -> None:
        while not self._requests_done.is_set():
            try:
                self._q.put(req, timeout=0.2)
                return
            except queue.Full:
                continue
        raise PboxError("the command's stream has ended; nothing more can be sent",
                        method="Exec")

    def write_stdin(self, data: Union[bytes, str]) -> None:
        """Sends bytes (or UTF-8 text) to the command's stdin (``exec(..., stdin=True)``).
        Blocks while the agent is behind. Raises PboxError once the command has ended."""
        for chunk in c.iter_chunks(c.to_bytes(data)):
            self._put(pb.ExecRequest(stdin=chunk))

    def close_stdin(self) -> None:
        """Closes the command's stdin (it sees EOF)."""
        if not self._requests_done.is_set():
            self._put(pb.ExecRequest(stdin_close=True))

    def signal(self, sig: int) -> None:
        """Sends a signal to the command's process group; a no-op once it has ended."""
        if not self._requests_done.is_set():
            try:
                self._put(pb.ExecRequest(signal=int(sig)))
            except PboxError:
                pass

    def kill(self) -> None:
        """SIGKILL to the command's process group."""
        self.signal(9)

    def _feed_in_background(self, data: bytes) -> None:
        def feed() -> None:
            try:
                self.write_stdin(data)
                self.close_stdin()
            except BaseException as e:  # reported by wait()/communicate()
                self._feed_error = e

        self._feeder = threading.Thread(target=feed, name="pbox-exec-stdin", daemon=True)
        self._feeder.start()

    def wait(self) -> RunResult:
        """Discards the output not yet read, waits for the end and returns the result."""
        for _ in self._responses:
            pass
        assert self.result is not None
        return self.result

    def communicate(self, input: Union[bytes, str, None] = None) -> RunResult:
        """Writes ``input`` (if any) and closes stdin, collects all output, returns the
        result with ``stdout``/``stderr`` filled (like ``subprocess.communicate``)."""
        if input is not None:
            self._feed_in_background(c.to_bytes(input))
        out: List[bytes] = []
        err: List[bytes] = []
        for stream, data in self._responses:
            (out if stream == "stdout" else err).append(data)
        assert self.result is not None
        self.result.stdout = b"".join(out)
        self.result.stderr = b"".join(err)
        return self.result

    def cancel(self) -> None:
        """Abandons the call; the agent kills the command."""
        self._end_requests()
        self._call.cancel()

    def __enter__(self) -> "ExecProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.result is None:
            self.kill()
            try:
                self.wait()
            except PboxError:
                pass
        self._end_requests()


# The Sandbox class the shared methods (pbox._shared) make for this client.
Client._Sandbox = Sandbox
