"""asyncio client for pbox, on ``grpc.aio``; the same surface as :mod:`pbox` with ``await``.

Example::

    import asyncio
    import pbox.aio

    async def main():
        async with pbox.aio.Client() as client:
            async with client.session(client_name="rollouts") as s:
                sb = await s.create(memory="512M")
                r = await sb.run(["python3", "-c", "print(1 + 1)"])
                print(r.stdout)

    asyncio.run(main())

A client's channel is bound to the event loop it is first used in; make one client per loop.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any, AsyncIterator, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

from . import _common as c
from . import _data
from . import _shared
from ._proto import pbox_pb2 as pb
from ._proto import pbox_pb2_grpc as pb_grpc
from .client import Data
from .errors import Internal, PboxError, SessionClosed, Unavailable, error_from_rpc, with_method
from .types import FileInfo, RunResult, SandboxInfo

__all__ = ["Client", "Session", "Sandbox", "ExecProcess"]


class Client(_shared.asynchronous(_shared.ClientMethods, __name__, "Client")):
    """An asyncio connection to one pboxd; arguments as :class:`pbox.Client`.

    File bytes move on the agent's data channel as in :class:`pbox.Client`, on non-blocking
    sockets of the client's event loop (never blocking it, except for local disk reads and
    writes of ``upload``/``download``)."""

    def __init__(self, endpoint: Optional[str] = None, token: Optional[str] = None, *,
                 timeout: Optional[float] = None, data_channel: bool = True) -> None:
        self.endpoint, self._target = c.resolve_endpoint(endpoint)
        self._md = c.metadata_for(c.resolve_token(token))
        self._timeout = timeout
        self._data = _data.FallbackState(data_channel)
        self._pool = _data.AsyncDataPool(c.tcp_host(self.endpoint, self._target))
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub_obj: Optional[pb_grpc.PboxStub] = None
        self._sessions: List["Session"] = []

    @property
    def _stub(self) -> pb_grpc.PboxStub:
        if self._stub_obj is None:
            self._channel = grpc.aio.insecure_channel(self._target, options=c.channel_options())
            self._stub_obj = pb_grpc.PboxStub(self._channel)
        return self._stub_obj

    def _error(self, err: grpc.RpcError, method: str) -> PboxError:
        e = error_from_rpc(err, method)
        if isinstance(e, Unavailable):
            return Unavailable(f"cannot reach pboxd at {self.endpoint}: {e.message}",
                               code=e.code, method=method)
        return e

    async def _unary(self, method: str, request: Any, deadline: bool = True) -> Any:
        try:
            return await getattr(self._stub, method)(
                request, metadata=self._md, timeout=self._timeout if deadline else None)
        except grpc.RpcError as e:
            raise self._error(e, method) from None

    async def _open_transfer(self, req: pb.OpenTransferRequest,
                             method: str) -> pb.OpenTransferResponse:
        try:
            resp = await self._stub.OpenTransfer(req, metadata=self._md, timeout=self._timeout)
        except grpc.RpcError as e:
            raise self._error(e, method) from None
        if len(resp.ticket) != _data.TICKET_BYTES:
            raise Internal(f"OpenTransfer: a ticket of {len(resp.ticket)} bytes, expected "
                           f"{_data.TICKET_BYTES}", method=method)
        return resp

    async def _data_upload(self, sandbox_id: str, path: str, mode: int, make_parents: bool,
                           data: Any) -> Optional[FileInfo]:
        """As :meth:`pbox.Client._data_upload`."""
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
                resp = await self._open_transfer(req, "WriteFile")
            except PboxError as e:
                if self._data.fall_back(e, data_socket=False):
                    return None
                raise
            try:
                st = await self._pool.upload(resp.data_endpoint, resp.ticket, src)
            except PboxError as e:
                if self._data.fall_back(e, data_socket=True):
                    return None
                raise with_method(e, "WriteFile") from None
        finally:
            src.close()
        src.sent()
        self._data.succeeded()
        return _data.file_info(path, st)

    async def _data_download(self, sandbox_id: str, path: str, offset: int, length: int,
                             out: Any = None) -> Any:
        """As :meth:`pbox.Client._data_download`."""
        if self._data.off:
            return None
        req = pb.OpenTransferRequest(
            sandbox_id=sandbox_id, path=path, direction=pb.TRANSFER_DIRECTION_DOWNLOAD,
            offset=offset, length=length)
        try:
            resp = await self._open_transfer(req, "ReadFile")
        except PboxError as e:
            if self._data.fall_back(e, data_socket=False):
                return None
            raise
        try:
            if out is None:
                got = await self._pool.download(resp.data_endpoint, resp.ticket)
            else:
                got = await self._pool.download_to(resp.data_endpoint, resp.ticket, out)
        except PboxError as e:
            if self._data.fall_back(e, data_socket=True):
                return None
            raise with_method(e, "ReadFile") from None
        self._data.succeeded()
        return got

    def session(self, client_name: str = "", job_id: str = "",
                ping_interval: Optional[float] = None, open_timeout: float = 30.0,
                cpuset: Union[str, Sequence[int]] = "") -> "Session":
        """A session; use ``async with client.session() as s`` (or ``await s.open()``).
        ``cpuset``: as for :meth:`pbox.Client.session`."""
        if not client_name:
            client_name = f"python-aio:{os.getpid()}"
        if not job_id:
            job_id = os.environ.get("SLURM_JOB_ID", "")
        s = Session(self, client_name, job_id, ping_interval, open_timeout,
                    c.cpu_list_text(cpuset))
        self._sessions = [x for x in self._sessions if not x.closed]
        self._sessions.append(s)
        return s

    async def close(self) -> None:
        """Closes open sessions (destroying their sandboxes) and the channel."""
        sessions, self._sessions = self._sessions, []
        for s in sessions:
            await s.close()
        self._pool.clear()  # the client may be used again, as its channel is reopened
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub_obj = None

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class _EndedCall(grpc.RpcError):
    """A call's final status, for error_from_rpc."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Session(_shared.asynchronous(_shared.SessionMethods, __name__, "Session")):
    """An asyncio session (lease); see :class:`pbox.Session`."""

    def __init__(self, client: Client, client_name: str, job_id: str,
                 ping_interval: Optional[float], open_timeout: float, cpuset: str = "") -> None:
        self._client = client
        self._client_name = client_name
        self._job_id = job_id
        self._cpuset = cpuset
        self._ping_interval = ping_interval
        self._open_timeout = open_timeout
        self._id = ""
        self._call: Any = None
        self._reader: Optional[asyncio.Task] = None
        self._pinger: Optional[asyncio.Task] = None
        self._done: Optional[asyncio.Event] = None  # made in open(), inside the loop
        self._error: Optional[PboxError] = None
        self._pongs: Dict[int, asyncio.Future] = {}
        self._nonce = itertools.count(1)
        self._closing = False
        self._write_lock: Optional[asyncio.Lock] = None

    @property
    def id(self) -> str:
        return self._id

    @property
    def closed(self) -> bool:
        return self._done is not None and self._done.is_set()

    async def _refusal(self) -> PboxError:
        """Why the agent ended the call without taking it: the call's final status."""
        code = await self._call.code()
        if code == grpc.StatusCode.OK:
            return SessionClosed("the agent ended the session before opening it",
                                 method="Session")
        return self._client._error(_EndedCall(code, await self._call.details()), "Session")

    async def _handshake(self) -> Any:
        # The agent sends "pbox-session: ready" before it reads SessionOpen, and ends a call it
        # refuses (a wrong token) at once (pbox.proto). Writing only after the former keeps the
        # refusal's status: a write into a call that has just ended fails locally, and gRPC
        # then reports its own INTERNAL "Internal error from Core" as the call's status.
        md = await self._call.initial_metadata()
        if md is None or "pbox-session" not in md:
            raise await self._refusal()
        await self._call.write(pb.SessionRequest(
            open=pb.SessionOpen(client_name=self._client_name, job_id=self._job_id,
                                cpuset=self._cpuset)))
        return await self._call.read()

    async def open(self) -> "Session":
        """Opens the stream and waits for the session id."""
        if self._call is not None:
            return self
        self._done = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._call = self._client._stub.Session(metadata=self._client._md)
        try:
            ev = await asyncio.wait_for(self._handshake(), self._open_timeout)
        except asyncio.TimeoutError:
            self._call.cancel()
            self._done.set()
            raise Unavailable(f"pboxd at {self._client.endpoint} did not open a session within "
                              f"{self._open_timeout:.0f} s", method="Session") from None
        except grpc.RpcError as e:
            self._done.set()
            raise self._client._error(e, "Session") from None
        except PboxError:
            self._done.set()
            raise
        if ev is grpc.aio.EOF or not ev.HasField("opened"):
            self._done.set()
            raise SessionClosed("the agent ended the session before opening it", method="Session")
        self._id = ev.opened.session_id
        self._reader = asyncio.ensure_future(self._read())
        if self._ping_interval:
            self._pinger = asyncio.ensure_future(self._ping_loop(self._ping_interval))
        return self

    async def _read(self) -> None:
        try:
            while True:
                ev = await self._call.read()
                if ev is grpc.aio.EOF:
                    break
                if ev.HasField("pong"):
                    fut = self._pongs.pop(ev.pong.nonce, None)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
        except (grpc.RpcError, asyncio.CancelledError) as e:
            if isinstance(e, grpc.RpcError) and not self._closing:
                self._error = self._client._error(e, "Session")
        finally:
            assert self._done is not None
            self._done.set()
            for fut in self._pongs.values():
                if not fut.done():
                    fut.set_exception(SessionClosed("session closed"))
            self._pongs.clear()

    async def _send(self, req: pb.SessionRequest) -> None:
        assert self._write_lock is not None
        async with self._write_lock:
            await self._call.write(req)

    async def _ping_loop(self, interval: float) -> None:
        assert self._done is not None
        while not self._done.is_set():
            await asyncio.sleep(interval)
            if self._done.is_set() or self._closing:
                return
            try:
                await self._send(pb.SessionRequest(ping=pb.Ping(nonce=next(self._nonce))))
            except Exception:
                return

    def _check_open(self) -> None:
        if self._call is None:
            raise SessionClosed("session not opened: use `async with client.session()` or "
                                "`await session.open()`")
        if self.closed or self._closing:
            reason = f": {self._error.message}" if self._error else ""
            raise SessionClosed(f"session {self._id} is closed{reason}")

    async def ping(self, timeout: float = 10.0) -> float:
        """Round trip time in seconds of a Ping on the session stream."""
        self._check_open()
        nonce = next(self._nonce)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pongs[nonce] = fut
        t0 = loop.time()
        await self._send(pb.SessionRequest(ping=pb.Ping(nonce=nonce)))
        await asyncio.wait_for(fut, timeout)
        return loop.time() - t0

    async def close(self, timeout: float = 30.0) -> None:
        """Half-closes the stream and waits until the agent has destroyed the sandboxes."""
        if self._call is None or self._closing:
            return
        self._closing = True
        if self._pinger is not None:
            self._pinger.cancel()
        assert self._done is not None
        try:
            if not self._done.is_set():
                assert self._write_lock is not None
                async with self._write_lock:
                    await self._call.done_writing()
            await asyncio.wait_for(self._done.wait(), timeout)
        except (asyncio.TimeoutError, grpc.RpcError):
            self._call.cancel()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass

    async def __aenter__(self) -> "Session":
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class Sandbox(_shared.asynchronous(_shared.SandboxMethods, __name__, "Sandbox")):
    """An asyncio handle on one sandbox; see :class:`pbox.Sandbox`."""

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
        return f"<pbox.aio.Sandbox {self.id}>"

    async def exec(self, argv: c.Argv, *, env: Optional[Mapping[str, str]] = None,
                   cwd: Optional[str] = None, timeout: Optional[float] = None,
                   stdin: Union[bool, bytes, str] = False) -> "ExecProcess":
        """Starts a streaming command; see :class:`ExecProcess`."""
        feed = None if isinstance(stdin, bool) else c.to_bytes(stdin)
        req, args = c.exec_start(self.id, argv, env, cwd, timeout, stdin is not False)
        proc = ExecProcess(self._client, args)
        await proc._start(req)
        if feed is not None:
            proc._feeder = asyncio.ensure_future(proc._feed(feed))
        return proc

    async def write_file(self, path: str, data: Data, mode: int = 0o644,
                         make_parents: bool = True, append: bool = False) -> FileInfo:
        """Writes data to ``path``; see :meth:`pbox.Sandbox.write_file`. A file object is read
        synchronously (a local disk read)."""
        c.check_mode(mode)
        if not append:
            info = await self._client._data_upload(self.id, path, mode, make_parents, data)
            if info is not None:
                return info
        call = self._client._stub.WriteFile(metadata=self._client._md)
        try:
            for req in c.write_requests(self.id, path, data, mode, make_parents, append):
                await call.write(req)
            await call.done_writing()
            return c.file_info(await call)
        except grpc.RpcError as e:
            raise self._client._error(e, "WriteFile") from None
        except BaseException:
            call.cancel()
            raise

    async def iter_read(self, path: str, offset: int = 0,
                        length: int = 0) -> AsyncIterator[bytes]:
        """Streams a file's bytes chunk by chunk."""
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        call = self._client._stub.ReadFile(
            pb.ReadFileRequest(sandbox_id=self.id, path=path, offset=offset, length=length),
            metadata=self._client._md)
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    return
                yield msg.chunk
        except grpc.RpcError as e:
            raise self._client._error(e, "ReadFile") from None
        finally:
            call.cancel()

    async def read_file(self, path: str, offset: int = 0, length: int = 0) -> bytes:
        """See :meth:`pbox.Sandbox.read_file`."""
        if offset < 0 or length < 0:
            raise ValueError("offset and length must be >= 0")
        got = await self._client._data_download(self.id, path, offset, length)
        if got is not None:
            return got
        parts = [chunk async for chunk in self.iter_read(path, offset, length)]
        return b"".join(parts)

    async def upload(self, local_path: Union[str, os.PathLike], remote_path: str,
                     mode: Optional[int] = None, make_parents: bool = True) -> FileInfo:
        with open(local_path, "rb") as f:
            if mode is None:
                mode = os.fstat(f.fileno()).st_mode & 0o777
            return await self.write_file(remote_path, f, mode=mode, make_parents=make_parents)

    async def download(self, remote_path: str, local_path: Union[str, os.PathLike]) -> int:
        n = 0
        tmp = f"{os.fspath(local_path)}.pbox-part"
        try:
            with open(tmp, "wb") as f:
                got = await self._client._data_download(self.id, remote_path, 0, 0, f)
                if got is not None:
                    n = got
                else:
                    f.seek(0)
                    f.truncate()
                    async for chunk in self.iter_read(remote_path):
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

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.destroy(missing_ok=True)


class ExecProcess:
    """An asyncio streaming command; ``async for stream, data in proc`` then ``proc.result``.
    See :class:`pbox.ExecProcess`."""

    def __init__(self, client: Client, argv: List[str]) -> None:
        self._client = client
        self.argv = argv
        self._call: Any = None
        self.result: Optional[RunResult] = None
        self._writes_done = False
        self._write_lock = asyncio.Lock()
        self._feeder: Optional[asyncio.Future] = None

    async def _start(self, start: pb.ExecRequest) -> None:
        self._call = self._client._stub.Exec(metadata=self._client._md)
        try:
            await self._call.write(start)
        except grpc.RpcError as e:
            raise self._client._error(e, "Exec") from None

    async def _send(self, req: pb.ExecRequest, quiet: bool = False) -> None:
        async with self._write_lock:
            if self._writes_done:
                if quiet:
                    return
                raise PboxError("the command's stream has ended; nothing more can be sent",
                                method="Exec")
            try:
                await self._call.write(req)
            except (grpc.RpcError, asyncio.InvalidStateError) as e:
                if not quiet:
                    raise PboxError(f"cannot send to the command: {e}", method="Exec") from None

    async def _end_writes(self) -> None:
        async with self._write_lock:
            if self._writes_done:
                return
            self._writes_done = True
            try:
                await self._call.done_writing()
            except (grpc.RpcError, asyncio.InvalidStateError):
                pass

    async def _feed(self, data: bytes) -> None:
        await self.write_stdin(data)
        await self.close_stdin()

    async def write_stdin(self, data: Union[bytes, str]) -> None:
        for chunk in c.iter_chunks(c.to_bytes(data)):
            await self._send(pb.ExecRequest(stdin=chunk))

    async def close_stdin(self) -> None:
        await self._send(pb.ExecRequest(stdin_close=True), quiet=True)

    async def signal(self, sig: int) -> None:
        await self._send(pb.ExecRequest(signal=int(sig)), quiet=True)

    async def kill(self) -> None:
        await self.signal(9)

    @property
    def done(self) -> bool:
        return self.result is not None

    async def read(self) -> Optional[Tuple[str, bytes]]:
        """The next ``(stream, data)``, or None once the command has ended (``result`` set)."""
        if self.result is not None:
            return None
        while True:
            try:
                msg = await self._call.read()
            except grpc.RpcError as e:
                self._writes_done = True
                raise self._client._error(e, "Exec") from None
            if msg is grpc.aio.EOF:
                await self._end_writes()
                raise PboxError("the agent ended the command's stream without a result",
                                method="Exec")
            kind = msg.WhichOneof("kind")
            if kind == "stdout":
                return "stdout", msg.stdout
            if kind == "stderr":
                return "stderr", msg.stderr
            if kind == "result":
                self.result = c.run_result(msg.result, argv=self.argv)
                await self._end_writes()
                return None

    def __aiter__(self) -> "ExecProcess":
        return self

    async def __anext__(self) -> Tuple[str, bytes]:
        item = await self.read()
        if item is None:
            raise StopAsyncIteration
        return item

    async def wait(self) -> RunResult:
        """Discards unread output and returns the result."""
        while await self.read() is not None:
            pass
        assert self.result is not None
        return self.result

    async def communicate(self, input: Union[bytes, str, None] = None) -> RunResult:
        """Feeds ``input``, closes stdin, collects all output; returns the full result."""
        if input is not None:
            self._feeder = asyncio.ensure_future(self._feed(c.to_bytes(input)))
        out: List[bytes] = []
        err: List[bytes] = []
        while (item := await self.read()) is not None:
            (out if item[0] == "stdout" else err).append(item[1])
        assert self.result is not None
        self.result.stdout = b"".join(out)
        self.result.stderr = b"".join(err)
        return self.result

    async def __aenter__(self) -> "ExecProcess":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.result is None:
            await self.kill()
            try:
                await self.wait()
            except PboxError:
                pass
        await self._end_writes()


# The Sandbox class the shared methods (pbox._shared) make for this client.
Client._Sandbox = Sandbox
