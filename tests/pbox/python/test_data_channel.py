"""The Python clients on the agent's data channel (docs/pbox.md "Data channel"): the same
results as the gRPC streams, the protocol against hostile peers, bad tickets, connections
broken mid-transfer, the fallback rules, concurrency, and the asyncio client."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import List, Optional

import pytest

import pbox
import pbox.aio
from pbox import _data
from pbox._proto import pbox_pb2 as pb

SIZES = [0, 1, (1 << 20) + 7, (3 << 20) + 5]  # the last is over one gRPC chunk and one
# download buffer


def _used_data_channel(client) -> bool:
    # A connection goes back to the pool only after a transfer that succeeded on it.
    return not client._data.off and client._pool.idle > 0


def _wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _no_upload_leftovers(sb: pbox.Sandbox, directory: str) -> bool:
    return not [e for e in sb.listdir(directory) if e.path.startswith(".pbox-upload-")]


# ---- the protocol, against peers of the test's own (no agent needed) ----


def test_request_and_status_layout() -> None:
    ticket = bytes(range(32))
    req = _data.encode_request(_data.OP_UPLOAD, 0x0102030405060708, ticket)
    assert len(req) == 48
    assert req[:4] == b"PBXD" and req[4] == 1 and req[5] == 1 and req[6:8] == b"\0\0"
    assert req[8:16] == bytes([8, 7, 6, 5, 4, 3, 2, 1]) and req[16:] == ticket
    with pytest.raises(ValueError):
        _data.encode_request(_data.OP_DOWNLOAD, 0, b"short")
    head = struct.pack("<4sIQIIqI", b"PBXS", 0, 5, 0o640, 0, 123, 0)
    assert _data.parse_status_head(head) == (0, _data.DataStatus(5, 0o640, 123), 0)
    for bad in (struct.pack("<4sIQIIqI", b"PBXX", 0, 0, 0, 0, 0, 0),
                struct.pack("<4sIQIIqI", b"PBXS", 17, 0, 0, 0, 0, 0),
                struct.pack("<4sIQIIqI", b"PBXS", 0, 0, 0, 0, 0, 4097)):
        with pytest.raises(pbox.Internal):
            _data.parse_status_head(bad)


class FakeDataServer:
    """A unix data socket that reads each request and answers with `reply(request)`, or not at
    all when it returns None (a stalled agent)."""

    def __init__(self, path: Path, reply) -> None:
        self.path = str(path)
        self.reply = reply
        self.requests: List[bytes] = []
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(8)
        self.conns: List[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"unix://{self.path}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                req = conn.recv(48, socket.MSG_WAITALL)
                if len(req) < 48:
                    return
                self.requests.append(req)
                if req[5] == _data.OP_UPLOAD:
                    size = struct.unpack_from("<Q", req, 8)[0]
                    assert len(conn.recv(size + 4, socket.MSG_WAITALL)) == size + 4
                out = self.reply(req)
                if out is None:
                    return
                conn.sendall(out)
        except OSError:
            pass

    def close(self) -> None:
        self.srv.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked on it
            except OSError:
                pass
            c.close()


def _status(code: int, nbytes: int = 0, message: bytes = b"") -> bytes:
    return struct.pack("<4sIQIIqI", b"PBXS", code, nbytes, 0, 0, 0, len(message)) + message


def test_hostile_and_failing_peers(tmp_path: Path) -> None:
    ticket = b"t" * 32
    # An agent error keeps its code and message; the connection is not reused after it.
    srv = FakeDataServer(tmp_path / "a", lambda req: _status(5, message=b"/x: No such file"))
    pool = _data.DataPool("")
    with pytest.raises(pbox.NotFound) as e:
        pool.download(srv.endpoint, ticket)
    assert e.value.message == "/x: No such file"
    assert pool.idle == 0
    srv.close()
    # Garbage instead of a status frame.
    srv = FakeDataServer(tmp_path / "b", lambda req: b"HTTP/1.1 400 Bad Request\r\n\r\n" * 2)
    with pytest.raises(pbox.Internal):
        pool.download(srv.endpoint, ticket)
    srv.close()
    # A download that promises more bytes than it sends, then closes: the caller falls back.
    srv = FakeDataServer(tmp_path / "c", lambda req: _status(0, 1000) + b"x" * 10)
    threading.Timer(0.2, srv.close).start()
    with pytest.raises(pbox.Unavailable, match="after 10 of 1000 bytes"):
        pool.download(srv.endpoint, ticket)
    # Downloads and uploads on one reused connection.
    answers = iter([_status(0, 3) + b"abc", _status(0, 7), _status(0, 0)])
    srv = FakeDataServer(tmp_path / "d", lambda req: next(answers))
    assert pool.download(srv.endpoint, ticket) == b"abc"
    src = _data.upload_source(b"payload")
    assert pool.upload(srv.endpoint, ticket, src).size == 7
    assert pool.download(srv.endpoint, ticket) == b""
    assert len(srv.conns) == 1 and pool.idle == 1
    assert srv.requests[1][5] == _data.OP_UPLOAD and srv.requests[1][8:16] == struct.pack("<Q", 7)
    pool.close()
    srv.close()
    # Nothing listening: Unavailable (the client then uses gRPC).
    with pytest.raises(pbox.Unavailable):
        _data.DataPool("").download(f"unix://{tmp_path}/none", ticket)
    with pytest.raises(pbox.Unavailable):
        _data.DataPool("").download("bogus://x", ticket)


def test_aio_stalled_transfer_does_not_block_the_loop(tmp_path: Path) -> None:
    srv = FakeDataServer(tmp_path / "s", lambda req: None)

    async def main() -> None:
        pool = _data.AsyncDataPool("")
        task = asyncio.ensure_future(pool.download(srv.endpoint, b"t" * 32))
        ticks = 0
        for _ in range(20):
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 20 and not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pool.idle == 0
        pool.close()

    asyncio.run(main())
    srv.close()


# ---- against a real agent ----


@pytest.fixture
def clients(agent):
    data, grpc_only = agent.client(), agent.client(data_channel=False)
    yield data, grpc_only
    data.close()
    grpc_only.close()


def test_both_paths_give_identical_results(clients, sandbox: pbox.Sandbox, tmp_path) -> None:
    data_c, grpc_c = clients
    via = {"data": data_c.get(sandbox.id), "grpc": grpc_c.get(sandbox.id)}
    for size in SIZES:
        payload = os.urandom(size)
        infos = {}
        for name, sb in via.items():
            infos[name] = sb.write_file(f"/tmp/dc/{name}/{size}", payload, mode=0o600)
        assert {(i.size, i.mode, i.type) for i in infos.values()} == {
            (size, 0o600, pbox.FileType.REGULAR)}
        for name, sb in via.items():
            for other in via:
                assert sb.read_file(f"/tmp/dc/{other}/{size}") == payload
            for off, length in [(1, 0), (size // 2, 10), (max(size - 1, 0), 100), (size + 5, 0)]:
                assert sb.read_file(f"/tmp/dc/data/{size}", off, length) == \
                    payload[off:off + length if length else None]
            local = tmp_path / f"{name}-{size}"
            assert sb.download(f"/tmp/dc/grpc/{size}", local) == size
            assert local.read_bytes() == payload
        st = {n: sb.stat(f"/tmp/dc/{n}/{size}") for n, sb in via.items()}
        assert st["data"].size == st["grpc"].size and st["data"].mode == st["grpc"].mode
    # Regular files go out with sendfile from their position; the position then moves to
    # the end on both paths.
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(2 << 20 | 3))
    os.chmod(src, 0o640)
    for name, sb in via.items():
        assert sb.upload(src, f"/tmp/dc/up-{name}").mode == 0o640
        with open(src, "rb") as f:
            f.read(100)
            info = sb.write_file(f"/tmp/dc/tail-{name}", f)
            assert f.tell() == src.stat().st_size
        assert info.size == src.stat().st_size - 100
        assert sb.read_file(f"/tmp/dc/tail-{name}") == src.read_bytes()[100:]
        buf = io.BytesIO(b"0123456789")
        buf.seek(4)
        assert sb.write_file(f"/tmp/dc/bio-{name}", buf).size == 6 and buf.tell() == 10
        buf.write(b"more")  # the client let go of the buffer
        assert sb.read_file(f"/tmp/dc/bio-{name}") == b"456789"
        assert sb.write_file(f"/tmp/dc/str-{name}", "unicodé").size == len("unicodé".encode())
    assert _used_data_channel(data_c) and grpc_c._pool.idle == 0


def test_both_paths_keep_the_same_semantics(clients, sandbox: pbox.Sandbox) -> None:
    data_c, grpc_c = clients
    via = {"data": data_c.get(sandbox.id), "grpc": grpc_c.get(sandbox.id)}
    for name, sb in via.items():
        d = f"/tmp/sem-{name}"
        sb.run(f"mkdir -p {d}/dir && printf old > {d}/target && chmod 600 {d}/target && "
               f"ln -s target {d}/link && ln -s made {d}/dangling && mkfifo {d}/fifo && "
               f"ln -s fifo {d}/to-fifo").check()
        info = sb.write_file(f"{d}/link", b"new", mode=0o644)
        assert info.size == 3 and info.mode == 0o600, name  # the existing file's mode stays
        assert sb.stat(f"{d}/link").is_symlink and sb.read_file(f"{d}/target") == b"new"
        sb.write_file(f"{d}/dangling", b"x", mode=0o640)
        assert sb.stat(f"{d}/made").mode == 0o640 and sb.stat(f"{d}/dangling").is_symlink
        sb.write_file(f"{d}/deep/er/f", b"p")  # make_parents
        assert sb.read_file(f"{d}/deep/er/f") == b"p"
        # Pipes have no size up front: the gRPC stream takes them on both clients.
        r, w = os.pipe()
        os.write(w, b"piped")
        os.close(w)
        with open(r, "rb") as f:
            assert sb.write_file(f"{d}/piped", f).size == 5
        sb.write_file(f"{d}/piped", b"+", append=True)
        assert sb.read_file(f"{d}/piped") == b"piped+"

    def errors(call):
        out = []
        for name, sb in via.items():
            with pytest.raises(pbox.PboxError) as e:
                call(sb, f"/tmp/sem-{name}")
            # The same class and call; the agent's wording differs between its two paths
            # ("resolve(PATH): ..." against "open for writing(PATH): ...").
            out.append((type(e.value), e.value.method))
            assert e.value.message
        assert out[0] == out[1], out
        return out[0][0]

    assert errors(lambda sb, d: sb.write_file(f"{d}/no/such/f", b"x",
                                              make_parents=False)) is pbox.NotFound
    assert errors(lambda sb, d: sb.read_file(f"{d}/missing")) is pbox.NotFound
    errors(lambda sb, d: sb.write_file(f"{d}/dir", b"x"))
    errors(lambda sb, d: sb.read_file(f"{d}/dir"))
    errors(lambda sb, d: sb.read_file("/proc/self/status"))
    errors(lambda sb, d: sb.write_file("/proc/self/comm", b"x"))
    # A new file in a kernel pseudo-filesystem: refused alike on both paths.
    assert errors(lambda sb, d: sb.write_file("/proc/pbox-new", b"x")) is pbox.PermissionDenied
    # Devices and FIFOs are refused, not replaced by a regular file.
    assert errors(lambda sb, d: sb.write_file("/dev/null", b"x")) is pbox.InvalidArgument
    assert errors(lambda sb, d: sb.write_file(f"{d}/fifo", b"x")) is pbox.InvalidArgument
    assert errors(lambda sb, d: sb.write_file(f"{d}/to-fifo", b"x")) is pbox.InvalidArgument
    assert sandbox.run("test -c /dev/null && test -p /tmp/sem-data/fifo").ok
    errors(lambda sb, d: sb.write_file("/usr/bin/pbox-test", b"x"))  # read-only image
    with pytest.raises(pbox.NotFound) as e:
        data_c.get(sandbox.id)._client._data_download("sb-missing", "/x", 0, 0)
    assert e.value.method == "ReadFile"
    assert _used_data_channel(data_c)


def test_bad_reused_and_misdirected_tickets(client: pbox.Client, sandbox: pbox.Sandbox) -> None:
    sandbox.write_file("/tmp/tk", b"secret")

    def ticket(direction, **kw):
        return client._open_transfer(pb.OpenTransferRequest(
            sandbox_id=sandbox.id, path="/tmp/tk", direction=direction, **kw), "ReadFile")

    pool = client._pool
    t = ticket(pb.TRANSFER_DIRECTION_DOWNLOAD)
    bad = bytes([t.ticket[0], t.ticket[1] ^ 1]) + t.ticket[2:]
    messages = set()
    with pytest.raises(pbox.PermissionDenied) as e:
        pool.download(t.data_endpoint, bad)
    messages.add(e.value.message)
    assert pool.download(t.data_endpoint, t.ticket) == b"secret"
    with pytest.raises(pbox.PermissionDenied) as e:
        pool.download(t.data_endpoint, t.ticket)  # used once already
    messages.add(e.value.message)
    up = ticket(pb.TRANSFER_DIRECTION_UPLOAD, size=1 << 20)
    with pytest.raises(pbox.PermissionDenied) as e:
        pool.download(up.data_endpoint, up.ticket)  # an upload's ticket
    messages.add(e.value.message)
    up = ticket(pb.TRANSFER_DIRECTION_UPLOAD, size=3 << 20)
    bad = bytes(32)
    with pytest.raises(pbox.PermissionDenied) as e:
        pool.upload(up.data_endpoint, bad, _data.upload_source(os.urandom(3 << 20)))
    messages.add(e.value.message)
    assert len(messages) == 1, messages  # refused alike
    # A ticket for an upload of a different size: the agent refuses the mismatch.
    up = ticket(pb.TRANSFER_DIRECTION_UPLOAD, size=10)
    with pytest.raises(pbox.PboxError) as e:
        pool.upload(up.data_endpoint, up.ticket, _data.upload_source(b"12345"))
    assert not isinstance(e.value, pbox.Unavailable), e.value
    # The file is untouched and the client carries on on the data channel.
    assert sandbox.read_file("/tmp/tk") == b"secret"
    sandbox.write_file("/tmp/tk", b"next")
    assert sandbox.read_file("/tmp/tk") == b"next" and _used_data_channel(client)
    assert client._data.failures == 0


class CuttingProxy:
    """Forwards each unix connection to `target`, breaking it (both sides) once `cut_up` bytes
    went client -> agent or `cut_down` bytes agent -> client."""

    def __init__(self, path: Path, target: str, cut_up: Optional[int] = None,
                 cut_down: Optional[int] = None) -> None:
        self.path = str(path)
        self.target = target
        self.cuts = (cut_up, cut_down)
        self.broken = 0
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(self.path)
        self.srv.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            b.connect(self.target)
            threading.Thread(target=self._pump, args=(a, b, self.cuts[0]), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, self.cuts[1]), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, cut: Optional[int]) -> None:
        moved = 0
        try:
            while True:
                chunk = src.recv(65536 if cut is None else min(65536, cut - moved))
                if not chunk:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(chunk)
                moved += len(chunk)
                if cut is not None and moved >= cut:
                    self.broken += 1
                    for s in (src, dst):
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        s.shutdown(socket.SHUT_RDWR)
                    return
        except OSError:
            pass

    def close(self) -> None:
        self.srv.close()


def test_broken_connections_fall_back_and_the_pool_recovers(agent, client: pbox.Client,
                                                            sandbox: pbox.Sandbox,
                                                            tmp_path) -> None:
    data_sock = f"{agent.socket}.data"
    payload = os.urandom((2 << 20) + 11)
    sandbox.write_file("/tmp/br/src", payload)
    pool = client._pool
    real_dial = pool.dial
    for n, cuts in enumerate([(300 << 10, None), (None, 500 << 10), (48, None), (None, 10)]):
        proxy = CuttingProxy(tmp_path / f"p{n}", data_sock, *cuts)
        pool.clear()
        pool.dial = lambda ep: real_dial(f"unix://{proxy.path}")
        try:
            # Each call breaks on the data channel, then goes again on gRPC.
            assert sandbox.write_file(f"/tmp/br/up{n}", payload).size == len(payload)
            assert sandbox.read_file("/tmp/br/src") == payload
            local = tmp_path / f"down{n}"
            assert sandbox.download("/tmp/br/src", local) == len(payload)
            assert local.read_bytes() == payload
        finally:
            del pool.dial
            proxy.close()
            pool.clear()
        assert proxy.broken >= 1
        assert client._data.failures == 3 or not client._data.off
        client._data.failures = 0
        client._data.off = False
        # Healthy again: the data channel carries the next transfers.
        assert sandbox.read_file(f"/tmp/br/up{n}") == payload
        assert client._data.failures == 0 and _used_data_channel(client)
    _wait_for(lambda: _no_upload_leftovers(sandbox, "/tmp/br"), "temporary upload files to go")
    # A pooled connection that the agent closed is noticed and replaced, not used.
    sandbox.read_file("/tmp/br/src", 0, 1)
    for _, sock, _ in pool._idle.items:
        sock.shutdown(socket.SHUT_RDWR)
    assert sandbox.read_file("/tmp/br/src", 5, 5) == payload[5:10]
    assert client._data.failures == 0 and pool.idle == 1


def test_unreachable_data_socket_turns_the_channel_off(client: pbox.Client,
                                                      sandbox: pbox.Sandbox, tmp_path) -> None:
    client._pool.clear()
    client._pool.dial = lambda ep: _data.DataPool("").dial(f"unix://{tmp_path}/nothing")
    for i in range(3):
        assert not client._data.off
        assert sandbox.write_file(f"/tmp/un{i}", b"x" * i).size == i
    assert client._data.off and client._data.failures == 3
    assert sandbox.read_file("/tmp/un2") == b"xx"


def test_agent_without_the_data_channel(make_agent, monkeypatch, tmp_path) -> None:
    a = make_agent(extra=["--data-channel=false"])
    with a.client() as cl, cl.session() as s:
        sb = s.create()
        assert sb.write_file("/tmp/f", b"abc", mode=0o600).mode == 0o600
        assert cl._data.off  # UNIMPLEMENTED: gRPC from now on
        assert sb.read_file("/tmp/f", 1) == b"bc"
        assert sb.download("/tmp/f", tmp_path / "f") == 3

    async def aio() -> None:
        async with pbox.aio.Client(a.endpoint) as ac:
            async with ac.session() as s:
                sb = await s.create()
                await sb.write_file("/tmp/g", b"xyz")
                assert ac._data.off
                assert await sb.read_file("/tmp/g") == b"xyz"

    asyncio.run(aio())
    monkeypatch.setenv("PBOX_DATA_CHANNEL", "0")
    with a.client() as cl:
        assert cl._data.off


def test_many_threads_to_many_sandboxes(client: pbox.Client, session: pbox.Session) -> None:
    sandboxes = [session.create(memory="256M") for _ in range(6)]
    errors: List[BaseException] = []

    def work(sb: pbox.Sandbox, seed: int) -> None:
        try:
            for i in range(6):
                payload = os.urandom((seed * 7919 + i * 104729) % (1536 << 10))
                path = f"/tmp/t/{seed}-{i % 2}"
                assert sb.write_file(path, payload).size == len(payload)
                assert sb.read_file(path) == payload
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(sb, n)) for n, sb in enumerate(sandboxes * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert client._data.failures == 0 and 1 <= client._pool.idle <= _data.MAX_IDLE


def test_aio_client_on_the_data_channel(agent, tmp_path) -> None:
    src = tmp_path / "src"
    src.write_bytes(os.urandom((1 << 20) + 5))

    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as ac, \
                pbox.aio.Client(agent.endpoint, data_channel=False) as gc:
            async with ac.session() as s:
                sbs = [await s.create(memory="256M") for _ in range(4)]

                async def work(sb, n: int) -> None:
                    for size in SIZES:
                        payload = os.urandom(size + n)
                        info = await sb.write_file(f"/tmp/a/{n}-{size}", payload, mode=0o640)
                        assert info.size == len(payload) and info.mode == 0o640
                        other = await gc.get(sb.id)
                        assert await other.read_file(f"/tmp/a/{n}-{size}") == payload
                        assert await sb.read_file(f"/tmp/a/{n}-{size}", 3, 1000) == payload[3:1003]
                    await sb.upload(src, f"/tmp/a/up{n}")
                    local = tmp_path / f"{sb.id}-{n}"
                    assert await sb.download(f"/tmp/a/up{n}", local) == src.stat().st_size
                    assert local.read_bytes() == src.read_bytes()
                    with pytest.raises(pbox.NotFound):
                        await sb.read_file("/tmp/a/missing")

                await asyncio.gather(*(work(sb, n) for n in range(2) for sb in sbs))
                assert ac._data.failures == 0 and _used_data_channel(ac)
                # A connection broken mid-download: gRPC brings the bytes instead.
                sb = sbs[0]
                big = os.urandom(2 << 20)
                await sb.write_file("/tmp/a/big", big)
                proxy = CuttingProxy(tmp_path / "ap", f"{agent.socket}.data", None, 100 << 10)
                real_dial = ac._pool.dial
                ac._pool.clear()

                async def dial(ep: str):
                    return await real_dial(f"unix://{proxy.path}")

                ac._pool.dial = dial
                assert await sb.read_file("/tmp/a/big") == big
                assert proxy.broken == 1 and ac._data.failures == 1 and ac._pool.idle == 0
                del ac._pool.dial
                proxy.close()
                assert await sb.read_file("/tmp/a/big") == big
                assert ac._data.failures == 0 and ac._pool.idle == 1

    asyncio.run(main())


def test_tcp_clients_use_the_data_port_at_the_host_they_reached(make_agent) -> None:
    a = make_agent(tcp_token="tok-0123456789abcdef")
    payload = os.urandom((1 << 20) + 3)
    with pbox.Client(a.tcp_endpoint, token="tok-0123456789abcdef") as cl, cl.session() as s:
        sb = s.create()
        assert sb.write_file("/tmp/t", payload).size == len(payload)
        assert sb.read_file("/tmp/t", 1) == payload[1:]
        assert _used_data_channel(cl)
        ep, sock, _ = cl._pool._idle.items[-1]
        assert ep.startswith("tcp://:") and sock.getpeername()[0] == "127.0.0.1"

        async def aio() -> None:
            async with pbox.aio.Client(a.tcp_endpoint, token="tok-0123456789abcdef") as ac:
                asb = await ac.get(sb.id)
                await asb.write_file("/tmp/u", payload)
                assert await asb.read_file("/tmp/u") == payload
                assert _used_data_channel(ac)

        asyncio.run(aio())
    # A wrong token gets no ticket: Unauthenticated, as on the gRPC path.
    with pbox.Client(a.tcp_endpoint, token="wrong-token-000000") as bad:
        with pytest.raises(pbox.Unauthenticated) as e:
            pbox.Sandbox(bad, sb.info).read_file("/tmp/t")
        assert e.value.method == "ReadFile" and not bad._data.off
