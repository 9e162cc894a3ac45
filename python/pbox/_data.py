"""The client side of the agent's data channel (not public API).

docs/pbox.md "Data channel" and src/pbox/wire/data_protocol.h describe it: the ``OpenTransfer`` RPC
gives a ticket and a data endpoint (``unix:///…/pbox.sock.data`` or ``tcp://:PORT``); on that
socket the client sends a 48-byte request and, for an upload, exactly ``size`` bytes and the
trailer ``PBXE``; the agent answers with a status frame, for a download followed by the bytes.
All integers are little-endian. A connection whose transfer succeeded carries the next one; any
error closes it.

:class:`DataPool` (blocking sockets, thread-safe) serves :class:`pbox.Client`;
:class:`AsyncDataPool` (non-blocking sockets on the running event loop, never blocking it)
serves :class:`pbox.aio.Client`. Both keep up to ``MAX_IDLE`` idle connections, each reused for
the next transfer to the same endpoint within ``MAX_IDLE_AGE_S``. :class:`FallbackState` holds
the rules for when a client uses the gRPC streams instead.

Errors are :class:`pbox.PboxError` subclasses: the agent's own status (code and message) for a
refused transfer; ``Unavailable`` when the connection cannot be made or breaks (the caller then
moves the bytes on the gRPC streams instead); ``DeadlineExceeded`` when it moves nothing for
``IO_TIMEOUT_S``; ``DataLoss`` when an upload's source file shrank while it was sent;
``Internal`` for a malformed answer.
"""

from __future__ import annotations

import asyncio
import io
import os
import select
import socket
import stat as stat_mod
import struct
import threading
import time
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from .errors import (DataLoss, DeadlineExceeded, Internal, PboxError, Unavailable, Unimplemented,
                     error_from_code)
from .types import FileInfo, FileType

TICKET_BYTES = 32
MAX_MESSAGE_BYTES = 4096
TRAILER = b"PBXE"
OP_UPLOAD = 1
OP_DOWNLOAD = 2
VERSION = 1
# "PBXD" | u8 version | u8 op | u16 0 | u64 size | ticket[32]
REQUEST = struct.Struct("<4sBBHQ32s")
# "PBXS" | u32 code | u64 bytes | u32 mode | u32 0 | i64 mtime_ns | u32 message length
STATUS_HEAD = struct.Struct("<4sIQIIqI")
assert REQUEST.size == 48 and STATUS_HEAD.size == 36
MAX_CODE = 16  # UNAUTHENTICATED, the last canonical code

# A transfer that moves nothing for this long fails (the agent's own stall limit is 30 s).
IO_TIMEOUT_S = 60
# Socket buffers that hold a MiB-sized transfer whole (best effort: net.core.[rw]mem_max).
SOCKET_BUFFER_BYTES = 2 << 20
MAX_IDLE = 64
MAX_IDLE_AGE_S = 20.0
# Downloads to a file go through one reused buffer of this size.
FILE_CHUNK_BYTES = 1 << 20
# The asyncio client keeps up to this many receive buffers of at most this size.
MAX_KEPT_BUFFERS = 4
MAX_KEPT_BUFFER_BYTES = 16 << 20
# Consecutive unreachable data sockets after which a client stops asking for tickets.
MAX_FAILURES = 3

_POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)
_TIMEVAL = struct.Struct("@ll")


class DataStatus(NamedTuple):
    """A status frame with code OK: ``size`` is the file's size after an upload, or the number
    of bytes that follow a download's frame."""

    size: int
    mode: int
    mtime_ns: int


def file_info(path: str, st: DataStatus) -> FileInfo:
    """The info of the file an upload wrote (as WriteFile returns it)."""
    return FileInfo(path=path, type=FileType.REGULAR, size=st.size, mode=st.mode,
                    mtime_unix_ns=st.mtime_ns, symlink_target="")


def encode_request(op: int, size: int, ticket: bytes) -> bytes:
    """Exactly 48 bytes. Raises ValueError for a ticket that is not 32 bytes."""
    if len(ticket) != TICKET_BYTES:
        raise ValueError(f"a ticket of {len(ticket)} bytes, expected {TICKET_BYTES}")
    return REQUEST.pack(b"PBXD", VERSION, op, 0, size, ticket)


def parse_status_head(head: bytes) -> Tuple[int, DataStatus, int]:
    """(code, status, message length) of a 36-byte status head; Internal if malformed."""
    magic, code, size, mode, _reserved, mtime_ns, length = STATUS_HEAD.unpack(head)
    if magic != b"PBXS":
        raise Internal("the data channel answered something that is not a status frame")
    if code > MAX_CODE:
        raise Internal(f"the data channel answered the unknown status code {code}")
    if length > MAX_MESSAGE_BYTES:
        raise Internal(f"the data channel answered a status message of {length} bytes "
                       f"(at most {MAX_MESSAGE_BYTES})")
    return code, DataStatus(size, mode, mtime_ns), length


class UploadSource:
    """What an upload sends: a buffer, or ``size`` bytes of a regular file from ``offset``."""

    def __init__(self, size: int, buf: Optional[memoryview] = None, fd: int = -1,
                 offset: int = 0, done: Optional[Callable[[], None]] = None,
                 release: Optional[Callable[[], None]] = None) -> None:
        self.size = size
        self.buf = buf
        self.fd = fd
        self.offset = offset
        self._done = done
        self._release = release

    def sent(self) -> None:
        """Moves a file object's position past what was sent (as reading it would have)."""
        if self._done is not None:
            self._done()

    def close(self) -> None:
        if self.buf is not None:
            self.buf.release()
        if self._release is not None:
            self._release()


def upload_source(data: Any) -> Optional[UploadSource]:
    """The source of an upload on the data channel, or None for data that only the gRPC stream
    takes (a file object that is not a regular file or a BytesIO: its size is not known up
    front)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    if data is None:
        data = b""
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
        return UploadSource(view.nbytes, buf=view)
    if isinstance(data, io.BytesIO):
        pos = data.tell()
        whole = data.getbuffer()
        view = whole[pos:]
        end = len(whole)

        def release() -> None:
            whole.release()

        return UploadSource(view.nbytes, buf=view, done=lambda: data.seek(end), release=release)
    if not isinstance(data, (io.BufferedIOBase, io.RawIOBase)):
        return None
    try:
        if not data.readable():
            return None
        fd = data.fileno()
        st = os.fstat(fd)
        pos = data.tell()
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return None
    if not stat_mod.S_ISREG(st.st_mode) or pos < 0:
        return None
    size = max(0, st.st_size - pos)
    return UploadSource(size, fd=fd, offset=pos, done=lambda: data.seek(pos + size))


class FallbackState:
    """When a client moves file bytes on the gRPC streams instead (docs/pbox.md "Data
    channel"): always once the agent answered UNIMPLEMENTED; for one call when the data socket
    could not be reached or broke, and for good after MAX_FAILURES such calls in a row.
    Thread-safe."""

    def __init__(self, enabled: bool) -> None:
        self.off = not enabled or os.environ.get("PBOX_DATA_CHANNEL") == "0"
        self.failures = 0
        self._lock = threading.Lock()

    def fall_back(self, err: PboxError, data_socket: bool) -> bool:
        """Whether the call that failed with ``err`` is to be made again on the gRPC streams.
        ``data_socket``: the error came from the data socket, not from ``OpenTransfer`` (an
        agent that cannot be reached at all says nothing about its data socket)."""
        if isinstance(err, Unimplemented) and not data_socket:
            self.off = True
            return True
        if isinstance(err, Unavailable):
            if not data_socket:
                return True
            with self._lock:
                self.failures += 1
                if self.failures >= MAX_FAILURES:
                    self.off = True
            return True
        return False

    def succeeded(self) -> None:
        self.failures = 0


def _connection_error(call: str, e: OSError) -> PboxError:
    if isinstance(e, (BlockingIOError, socket.timeout, TimeoutError)):
        return DeadlineExceeded(f"data connection: {call} made no progress for {IO_TIMEOUT_S} s")
    return Unavailable(f"data connection: {call}: {e.strerror or e}")


def _closed_early(got: int, want: int) -> PboxError:
    # Unavailable, not DataLoss: nothing reached the caller yet, so the call is made again on
    # the gRPC streams.
    return Unavailable(f"data connection: the agent closed it after {got} of {want} bytes")


def _split_endpoint(endpoint: str, tcp_host: str) -> Tuple[int, Any]:
    """(address family, address) of a data endpoint."""
    if endpoint.startswith("unix://"):
        return socket.AF_UNIX, endpoint[len("unix://"):]
    if not endpoint.startswith("tcp://"):
        raise Unavailable(f"data endpoint {endpoint!r} is not understood")
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit():
        raise Unavailable(f"data endpoint {endpoint!r} has no port")
    if not host:
        host = tcp_host
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return socket.AF_INET, (host, int(port))


def _tune(sock: socket.socket, tcp: bool) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
        except OSError:
            pass
    if tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _is_stale(sock: socket.socket) -> bool:
    # An idle connection has nothing to read: anything there (EOF, a reset, stray bytes) means
    # the agent closed it or it is out of step.
    try:
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN | _POLLRDHUP)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return True


class _Idle:
    """The idle connections of one pool (callers hold the pool's lock)."""

    def __init__(self) -> None:
        self.items: List[Tuple[str, socket.socket, float]] = []

    def take(self, endpoint: str) -> Optional[socket.socket]:
        now = time.monotonic()
        # The newest first: it is the least likely to have been closed by the agent.
        for i in range(len(self.items) - 1, -1, -1):
            ep, sock, since = self.items[i]
            if ep != endpoint:
                continue
            del self.items[i]
            if now - since < MAX_IDLE_AGE_S and not _is_stale(sock):
                return sock
            sock.close()
        return None

    def put(self, endpoint: str, sock: socket.socket) -> None:
        if len(self.items) >= MAX_IDLE:
            self.items.pop(0)[1].close()
        self.items.append((endpoint, sock, time.monotonic()))

    def close(self) -> None:
        items, self.items = self.items, []
        for _, sock, _ in items:
            sock.close()


class DataPool:
    """Blocking transfers on pooled connections. Thread-safe: each transfer holds its own
    connection. ``tcp_host``: the host ``tcp://:PORT`` endpoints mean (the one the client
    reached the agent at). ``close()`` closes the idle connections."""

    def __init__(self, tcp_host: str) -> None:
        self._tcp_host = tcp_host
        self._lock = threading.Lock()
        self._idle = _Idle()
        self._closed = False

    @property
    def idle(self) -> int:
        """Idle connections held now."""
        with self._lock:
            return len(self._idle.items)

    def dial(self, endpoint: str) -> socket.socket:
        """A new connection to ``endpoint``; Unavailable if nothing listens there."""
        family, addr = _split_endpoint(endpoint, self._tcp_host)
        try:
            if family == socket.AF_UNIX:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(addr)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection(addr, timeout=IO_TIMEOUT_S)
        except OSError as e:
            raise Unavailable(f"cannot connect to the data socket {endpoint} "
                              f"({addr}): {e.strerror or e}") from None
        # Blocking with kernel timeouts (as the C++ client): recv(MSG_WAITALL) then fills a
        # whole download in one call, where a Python-level timeout would poll before each read.
        sock.settimeout(None)
        tv = _TIMEVAL.pack(IO_TIMEOUT_S, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        _tune(sock, family != socket.AF_UNIX)
        return sock

    def _acquire(self, endpoint: str) -> socket.socket:
        with self._lock:
            sock = self._idle.take(endpoint)
        return sock if sock is not None else self.dial(endpoint)

    def _release(self, endpoint: str, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.put(endpoint, sock)
                return
        sock.close()

    def clear(self) -> None:
        """Closes the idle connections; later transfers dial new ones."""
        with self._lock:
            self._idle.close()

    def close(self) -> None:
        """Closes the idle connections and those of transfers still running when they end."""
        with self._lock:
            self._closed = True
            self._idle.close()

    # ---- transfers ----

    def upload(self, endpoint: str, ticket: bytes, src: UploadSource) -> DataStatus:
        """Sends ``src`` for the upload ``ticket`` admits; returns the agent's OK status (the
        file's size, mode and mtime) or raises its error (or the connection's)."""
        sock = self._acquire(endpoint)
        try:
            head = encode_request(OP_UPLOAD, src.size, ticket)
            try:
                if src.buf is not None:
                    _send_all(sock, [head, src.buf, TRAILER])
                else:
                    _send_all(sock, [head])
                    _send_file(sock, src.fd, src.offset, src.size)
                    _send_all(sock, [TRAILER])
            except OSError as e:
                raise _reason_after_send_error(sock, _connection_error("send", e)) from None
            st = _read_status(sock)
        except BaseException:
            sock.close()
            raise
        self._release(endpoint, sock)
        return st

    def download(self, endpoint: str, ticket: bytes) -> bytes:
        """The bytes the download ``ticket`` admits."""
        sock = self._acquire(endpoint)
        try:
            st = self._start_download(sock, ticket)
            data = _recv_exact(sock, st.size)
        except BaseException:
            sock.close()
            raise
        self._release(endpoint, sock)
        return data

    def download_to(self, endpoint: str, ticket: bytes, out: Any) -> int:
        """Writes the bytes the download ``ticket`` admits to the binary file ``out``; returns
        their count. An error may leave part of them written."""
        sock = self._acquire(endpoint)
        try:
            st = self._start_download(sock, ticket)
            buf = bytearray(min(st.size, FILE_CHUNK_BYTES))
            view = memoryview(buf)
            left = st.size
            while left > 0:
                n = min(left, len(buf))
                _recv_into_exact(sock, view[:n], st.size - left, st.size)
                out.write(view[:n])
                left -= n
        except BaseException:
            sock.close()
            raise
        self._release(endpoint, sock)
        return st.size

    def _start_download(self, sock: socket.socket, ticket: bytes) -> DataStatus:
        try:
            _send_all(sock, [encode_request(OP_DOWNLOAD, 0, ticket)])
        except OSError as e:
            raise _reason_after_send_error(sock, _connection_error("send", e)) from None
        return _read_status(sock)


def _send_all(sock: socket.socket, parts: List[Any]) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if v.nbytes]
    while views:
        n = sock.sendmsg(views, [], socket.MSG_NOSIGNAL)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _send_file(sock: socket.socket, fd: int, offset: int, size: int) -> None:
    left = size
    while left > 0:
        n = os.sendfile(sock.fileno(), fd, offset, min(left, 1 << 30))
        if n == 0:
            # The source shrank: closing without the trailer makes the agent discard it.
            raise DataLoss(f"the upload source ended {left} bytes early (it shrank while "
                           f"being sent)")
        offset += n
        left -= n


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    if size == 0:
        return b""
    try:
        # One call fills the result in place on a blocking socket.
        data = sock.recv(size, socket.MSG_WAITALL)
    except OSError as e:
        raise _connection_error("recv", e) from None
    if len(data) == size:
        return data
    if not data:
        raise _closed_early(0, size)
    buf = bytearray(size)
    buf[:len(data)] = data
    _recv_into_exact(sock, memoryview(buf)[len(data):], len(data), size)
    return bytes(buf)


def _recv_into_exact(sock: socket.socket, view: memoryview, before: int, total: int) -> None:
    got = 0
    want = view.nbytes
    while got < want:
        try:
            n = sock.recv_into(view[got:], want - got, socket.MSG_WAITALL)
        except OSError as e:
            raise _connection_error("recv", e) from None
        if n == 0:
            raise _closed_early(before + got, total)
        got += n


def _read_status(sock: socket.socket) -> DataStatus:
    head = _recv_exact(sock, STATUS_HEAD.size)
    code, st, length = parse_status_head(head)
    message = _recv_exact(sock, length).decode("utf-8", "replace") if length else ""
    if code != 0:
        raise error_from_code(code, message)
    return st


def _reason_after_send_error(sock: socket.socket, send_error: PboxError) -> PboxError:
    # After a failed send the agent may have refused the transfer: its reason beats EPIPE.
    try:
        _read_status(sock)
    except (Unavailable, DeadlineExceeded, DataLoss):
        return send_error
    except PboxError as e:
        return e
    return send_error


# ---- asyncio ----


class AsyncDataPool:
    """The same transfers on non-blocking sockets, awaited on the running loop. For one event
    loop (as the asyncio client's channel). A transfer that is cancelled closes its
    connection."""

    def __init__(self, tcp_host: str) -> None:
        self._tcp_host = tcp_host
        self._idle = _Idle()
        self._closed = False
        # Receive buffers kept for the next download: a fresh MiB-sized bytearray next to the
        # bytes copied out of it costs ~1 ms of page faults per call (glibc returns both to the
        # kernel), ten times the copy itself.
        self._buffers: List[bytearray] = []

    @property
    def idle(self) -> int:
        return len(self._idle.items)

    def _buffer(self, size: int) -> bytearray:
        for i, buf in enumerate(self._buffers):
            if len(buf) >= size:
                return self._buffers.pop(i)
        return bytearray(size)

    def _keep(self, buf: bytearray) -> None:
        if len(buf) <= MAX_KEPT_BUFFER_BYTES and len(self._buffers) < MAX_KEPT_BUFFERS:
            self._buffers.append(buf)

    async def dial(self, endpoint: str) -> socket.socket:
        family, addr = _split_endpoint(endpoint, self._tcp_host)
        loop = asyncio.get_running_loop()
        try:
            if family == socket.AF_UNIX:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, addr)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = await _async_connect_tcp(loop, addr)
        except OSError as e:
            raise Unavailable(f"cannot connect to the data socket {endpoint} "
                              f"({addr}): {e.strerror or e}") from None
        _tune(sock, family != socket.AF_UNIX)
        return sock

    async def _acquire(self, endpoint: str) -> socket.socket:
        sock = self._idle.take(endpoint)
        return sock if sock is not None else await self.dial(endpoint)

    def _release(self, endpoint: str, sock: socket.socket) -> None:
        if self._closed:
            sock.close()
        else:
            self._idle.put(endpoint, sock)

    def clear(self) -> None:
        self._idle.close()

    def close(self) -> None:
        self._closed = True
        self._idle.close()

    async def upload(self, endpoint: str, ticket: bytes, src: UploadSource) -> DataStatus:
        sock = await self._acquire(endpoint)
        try:
            async with _Progress() as progress:
                io_ = _AsyncIo(sock, progress)
                head = encode_request(OP_UPLOAD, src.size, ticket)
                try:
                    if src.buf is not None:
                        await io_.send_all([head, src.buf, TRAILER])
                    else:
                        await io_.send_all([head])
                        await io_.send_file(src.fd, src.offset, src.size)
                        await io_.send_all([TRAILER])
                except OSError as e:
                    raise await io_.reason_after_send_error(
                        _connection_error("send", e)) from None
                st = await io_.read_status()
        except BaseException:
            sock.close()
            raise
        self._release(endpoint, sock)
        return st

    async def download(self, endpoint: str, ticket: bytes) -> bytes:
        sock = await self._acquire(endpoint)
        try:
            async with _Progress() as progress:
                io_ = _AsyncIo(sock, progress)
                st = await io_.start_download(ticket)
                buf = self._buffer(st.size)
                with memoryview(buf) as view:
                    await io_.recv_into_exact(view[:st.size], 0, st.size)
                    data = bytes(view[:st.size])
                self._keep(buf)
        except BaseException:
            sock.close()
            raise
        self._release(endpoint, sock)
        return data

    async def download_to(self, endpoint: str, ticket: bytes, out: Any) -> int:
        sock = await self._acquire(endpoint)
        try:
            async with _Progress() as progress:
                io_ = _AsyncIo(sock, progress)
                st = await io_.start_download(ticket)
                chunk = min(st.size, FILE_CHUNK_BYTES)
                buf = self._buffer(chunk)
                with memoryview(buf) as view:
                    left = st.size
                    while left > 0:
                        n = min(left, chunk)
                        await io_.recv_into_exact(view[:n], st.size - left, st.size)
                        out.write(view[:n])
                        left -= n
                self._keep(buf)
        except BaseException:
            sock.close()
            raise
        self._release(endpoint, sock)
        return st.size


async def _async_connect_tcp(loop: asyncio.AbstractEventLoop, addr: Tuple[str, int]
                             ) -> socket.socket:
    infos = await loop.getaddrinfo(addr[0], addr[1], type=socket.SOCK_STREAM)
    err: OSError = ConnectionRefusedError(111, "Connection refused")
    for family, type_, proto, _, sockaddr in infos:
        sock = socket.socket(family, type_, proto)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, sockaddr), IO_TIMEOUT_S)
            return sock
        except asyncio.TimeoutError:
            sock.close()
            err = TimeoutError(110, "Connection timed out")
        except OSError as e:
            sock.close()
            err = e
        except BaseException:
            sock.close()
            raise
    raise err


class _Progress:
    """A deadline IO_TIMEOUT_S ahead, pushed back by every step that moved bytes."""

    def __init__(self) -> None:
        self._cm = asyncio.timeout(IO_TIMEOUT_S)
        self._loop = asyncio.get_running_loop()

    def moved(self) -> None:
        self._cm.reschedule(self._loop.time() + IO_TIMEOUT_S)

    async def __aenter__(self) -> "_Progress":
        await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self._cm.__aexit__(*exc)
        except TimeoutError:
            raise DeadlineExceeded(
                f"data connection: the transfer made no progress for {IO_TIMEOUT_S} s") from None


class _AsyncIo:
    """One transfer's I/O on a non-blocking socket: each call is tried at once and waits for
    readiness only when the socket would block."""

    def __init__(self, sock: socket.socket, progress: _Progress) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._progress = progress
        self._loop = asyncio.get_running_loop()

    async def _ready(self, write: bool) -> None:
        fut = self._loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        if write:
            self._loop.add_writer(self._fd, wake)
        else:
            self._loop.add_reader(self._fd, wake)
        try:
            await fut
        finally:
            if write:
                self._loop.remove_writer(self._fd)
            else:
                self._loop.remove_reader(self._fd)

    async def send_all(self, parts: List[Any]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        views = [v for v in views if v.nbytes]
        while views:
            try:
                n = self._sock.sendmsg(views, [], socket.MSG_NOSIGNAL)
            except BlockingIOError:
                await self._ready(True)
                continue
            self._progress.moved()
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]

    async def send_file(self, fd: int, offset: int, size: int) -> None:
        left = size
        while left > 0:
            try:
                n = os.sendfile(self._fd, fd, offset, min(left, 1 << 30))
            except BlockingIOError:
                await self._ready(True)
                continue
            if n == 0:
                raise DataLoss(f"the upload source ended {left} bytes early (it shrank while "
                               f"being sent)")
            self._progress.moved()
            offset += n
            left -= n

    async def recv_into_exact(self, view: memoryview, before: int, total: int) -> None:
        got = 0
        want = view.nbytes
        while got < want:
            try:
                n = self._sock.recv_into(view[got:], want - got)
            except BlockingIOError:
                await self._ready(False)
                continue
            except OSError as e:
                raise _connection_error("recv", e) from None
            if n == 0:
                raise _closed_early(before + got, total)
            self._progress.moved()
            got += n

    async def read_status(self) -> DataStatus:
        head = bytearray(STATUS_HEAD.size)
        await self.recv_into_exact(memoryview(head), 0, len(head))
        code, st, length = parse_status_head(bytes(head))
        message = ""
        if length:
            raw = bytearray(length)
            await self.recv_into_exact(memoryview(raw), 0, length)
            message = raw.decode("utf-8", "replace")
        if code != 0:
            raise error_from_code(code, message)
        return st

    async def reason_after_send_error(self, send_error: PboxError) -> PboxError:
        try:
            await self.read_status()
        except (Unavailable, DeadlineExceeded, DataLoss):
            return send_error
        except PboxError as e:
            return e
        return send_error

    async def start_download(self, ticket: bytes) -> DataStatus:
        try:
            await self.send_all([encode_request(OP_DOWNLOAD, 0, ticket)])
        except OSError as e:
            raise await self.reason_after_send_error(_connection_error("send", e)) from None
        return await self.read_status()
