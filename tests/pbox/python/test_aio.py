"""The asyncio client against the real agent: every call of pbox.aio."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal

import pytest

import pbox
import pbox.aio


def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_aio_agent_and_sandbox_lifecycle(agent) -> None:
    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as c:
            info = await c.info()
            assert "host" in info.images
            assert (await c.health()).serving
            sb = await c.create(memory="128M", labels={"k": "v"})
            assert sb.info.spec.memory_bytes == 128 << 20
            assert (await c.get(sb.id)).info.spec.labels == {"k": "v"}
            assert sb.id in [x.id for x in await c.list()]
            assert (await sb.refresh()).state == "running"
            await sb.destroy()
            with pytest.raises(pbox.NotFound):
                await c.get(sb.id)
            with pytest.raises(pbox.NotFound):
                await sb.destroy()
            await sb.destroy(missing_ok=True)
            with pytest.raises(ValueError, match="memory"):
                await c.create(memory="12Q")

    arun(main())


def test_aio_session_closes_its_sandboxes(agent) -> None:
    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as c:
            async with c.session(client_name="aio", ping_interval=0.1) as s:
                assert s.id
                sbs = await asyncio.gather(*(s.create() for _ in range(5)))
                assert {x.id for x in await s.list()} == {x.id for x in sbs}
                assert await s.ping() < 5
                await asyncio.sleep(0.3)
                results = await asyncio.gather(*(sb.run(["echo", sb.id]) for sb in sbs))
                assert [r.stdout.decode().strip() for r in results] == [sb.id for sb in sbs]
            assert s.closed
            assert await c.list(s.id) == []
            with pytest.raises(pbox.SessionClosed):
                await s.create()
            async with c.session() as s2:
                async with await s2.create() as sb:
                    assert (await sb.run("true")).ok
                assert await s2.list() == []

    arun(main())


def test_aio_run_and_exec(agent) -> None:
    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as c, c.session() as s:
            sb = await s.create()
            r = await sb.run("echo $X; echo e >&2; exit 5", env={"X": "1"})
            assert (r.stdout, r.stderr, r.exit_code) == (b"1\n", b"e\n", 5)
            r = await sb.run(["cat"], stdin=b"abc", cwd="/tmp")
            assert r.stdout == b"abc"
            r = await sb.run(["sleep", "10"], timeout=0.3)
            assert r.timed_out
            r = await sb.run("head -c 2000000 /dev/zero", max_output="10K")
            assert r.stdout_truncated and r.stdout_bytes == 2000000

            p = await sb.exec(["cat"], stdin=True)
            await p.write_stdin(b"ping")
            item = await p.read()
            assert item == ("stdout", b"ping")
            await p.write_stdin("pong")
            assert await p.read() == ("stdout", b"pong")
            await p.close_stdin()
            assert (await p.wait()).exit_code == 0

            p = await sb.exec(["sh", "-c", "cat; echo done >&2"], stdin=b"x" * 3000000)
            r = await p.communicate()
            assert r.stdout == b"x" * 3000000 and r.stderr == b"done\n"

            async with await sb.exec(["sh", "-c", "echo up; sleep 1000"]) as p:
                async for stream, data in p:
                    assert data == b"up\n"
                    await p.signal(signal.SIGTERM)
            assert p.result.signal == signal.SIGTERM

            async with await sb.exec(["sleep", "1000"]) as p:
                pass
            assert p.result.signal == signal.SIGKILL

    arun(main())


def test_aio_files(agent, tmp_path) -> None:
    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as c, c.session() as s:
            sb = await s.create(disk="256M")
            data = os.urandom(50 << 20)
            info = await sb.write_file("/tmp/big", data)
            assert info.size == len(data)
            back = await sb.read_file("/tmp/big")
            assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
            assert await sb.read_file("/tmp/big", offset=123, length=1000) == data[123:1123]
            src = tmp_path / "src"
            src.write_bytes(data[:1 << 20])
            await sb.upload(src, "/tmp/up/src")
            assert await sb.download("/tmp/up/src", tmp_path / "dst") == 1 << 20
            assert (tmp_path / "dst").read_bytes() == data[:1 << 20]
            await sb.mkdir("/tmp/d/e")
            assert [e.path for e in await sb.listdir("/tmp/d")] == ["e"]
            assert (await sb.stat("/tmp/d/e")).is_dir
            await sb.move("/tmp/up/src", "/tmp/d/moved")
            assert await sb.exists("/tmp/d/moved")
            assert not await sb.exists("/tmp/up/src")
            await sb.remove("/tmp/d", recursive=True)
            assert not await sb.exists("/tmp/d")
            with pytest.raises(pbox.NotFound):
                await sb.read_file("/tmp/nope")
            with pytest.raises(pbox.NotFound):
                await sb.stat("/tmp/nope")

    arun(main())


def test_aio_many_concurrent_sandboxes(agent) -> None:
    async def one(s: pbox.aio.Session, i: int) -> bytes:
        async with await s.create(memory="64M", disk="16M") as sb:
            await sb.write_file("/tmp/in", str(i))
            r = await sb.run(["sh", "-c", "cat /tmp/in; echo"])
            return r.stdout

    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as c, c.session() as s:
            outs = await asyncio.gather(*(one(s, i) for i in range(20)))
            assert outs == [f"{i}\n".encode() for i in range(20)]

    arun(main())
