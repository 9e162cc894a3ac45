"""The asyncio client's image calls and Sandbox.read_text against the real agent (the methods
it shares with the blocking client through pbox._shared)."""

from __future__ import annotations

import asyncio
import io
import tarfile

import pytest

import pbox
import pbox.aio


def arun(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def rootfs_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"from the aio client\n"
        ti = tarfile.TarInfo("etc/marker")
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def test_aio_images(agent) -> None:
    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as c:
            assert "host" in [i.name for i in await c.list_images()]
            info = await c.import_image("aio-marker", io.BytesIO(rootfs_tar()))
            assert info.name == "aio-marker"
            assert "aio-marker" in [i.name for i in await c.list_images()]
            await c.remove_image("aio-marker")
            assert "aio-marker" not in [i.name for i in await c.list_images()]
            with pytest.raises(pbox.NotFound):
                await c.remove_image("aio-marker")
            assert (await c.prune_images()).bytes_freed >= 0

    arun(main())


def test_aio_read_text(agent) -> None:
    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as c:
            async with await c.create(memory="64M") as sb:
                await sb.write_file("/tmp/t.txt", "héllo")
                assert await sb.read_text("/tmp/t.txt") == "héllo"

    arun(main())
