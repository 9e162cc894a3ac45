"""Sandbox.clone (sync and asyncio) against the real agent: inherited files and spec,
isolation, sessions, argument checks and errors."""

from __future__ import annotations

import asyncio
import time

import pytest

import pbox
import pbox.aio
from pbox._proto import pbox_pb2 as pb


def test_clone_in_a_session(session: pbox.Session) -> None:
    src = session.create(memory="128M", disk="64M", env={"TASK": "t1"}, labels={"g": "1"})
    src.write_file("/task/prompt.txt", "2+2?\n", mode=0o600)
    src.run("rm /etc/hostname")
    clones = src.clone(3, memory="96M", env={"SEED": "5"})
    assert len(clones) == 3
    assert len({c.id for c in clones} | {src.id}) == 4
    for i, c in enumerate(clones):
        assert c.session_id == session.id
        assert c.info.spec.memory_bytes == 96 << 20
        assert c.info.spec.labels == {"g": "1"}
        assert c.read_text("/task/prompt.txt") == "2+2?\n"
        assert c.stat("/task/prompt.txt").mode == 0o600
        assert not c.exists("/etc/hostname")
        assert c.run("echo $TASK $SEED").stdout == b"t1 5\n"
        c.write_file("/task/answer.txt", f"{i}\n")
    # Each answer stays in its clone; the source never sees one.
    for i, c in enumerate(clones):
        assert c.read_text("/task/answer.txt") == f"{i}\n"
    assert not src.exists("/task/answer.txt")
    # The clones are ordinary sandboxes of the session.
    assert {c.id for c in clones} <= {s.id for s in session.list()}
    for c in clones:
        c.destroy()


def test_clone_errors(client: pbox.Client, session: pbox.Session) -> None:
    src = session.create(memory="64M", disk="16M")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="n:"):
            src.clone(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory"):
        src.clone(1, memory="12Q")
    with pytest.raises(pbox.ResourceExhausted, match="no clone was made"):
        src.clone(1000)
    with pytest.raises(pbox.InvalidArgument, match="memory"):
        src.clone(1, memory="1M")
    gone = session.create(memory="64M", disk="16M")
    gone.destroy()
    with pytest.raises(pbox.NotFound):
        gone.clone(1)
    # Another session's sandbox is not this one's to copy.
    with client.session(client_name="other") as other:
        foreign = other.create(memory="64M", disk="16M")
        # Sandbox.clone always asks for the source's own session; ask for another one raw.
        with pytest.raises(pbox.PermissionDenied):
            client._unary("CloneSandbox", pb.CloneSandboxRequest(
                sandbox_id=foreign.id, count=1, session_id=session.id))


def test_aio_clone(agent) -> None:
    async def main() -> None:
        async with pbox.aio.Client(agent.endpoint) as c:
            src = await c.create(memory="64M", disk="16M", idle_ttl=120)
            try:
                await src.write_file("/x", b"aio")
                clones = await src.clone(2)
                assert len(clones) == 2
                for cl in clones:
                    assert cl.session_id == ""
                    assert cl.info.spec.idle_ttl_seconds == 120
                    assert await cl.read_file("/x") == b"aio"
                    await cl.destroy()
                with pytest.raises(ValueError):
                    await src.clone(0)
            finally:
                await src.destroy(missing_ok=True)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_writes_just_before_the_call_are_in_the_clones(session: pbox.Session) -> None:
    """A file just written, one still open in a live process and a shared mapping never
    msync'ed: all in the clones (under gVisor the mapping's pages may sit in the sentry
    until the clone's sync)."""
    src = session.create(memory="128M", disk="64M")
    src.run("mkdir -p /w && (exec 3>/w/open; echo held >&3; exec sleep 1000) "
            ">/dev/null 2>&1 &").check()
    with src.exec(["python3", "-c",
                   "import mmap, os, sys, time\n"
                   "fd = os.open('/w/mapped', os.O_RDWR | os.O_CREAT, 0o644)\n"
                   "os.ftruncate(fd, 4096)\n"
                   "m = mmap.mmap(fd, 4096)\n"
                   "m[:7] = b'mapped!'\n"
                   "print('ready', flush=True)\n"
                   "time.sleep(1000)\n"]) as writer:
        assert next(iter(writer.stdout_iter())) == b"ready\n"
        deadline = time.monotonic() + 60
        while not src.exists("/w/open") or src.read_file("/w/open") != b"held\n":
            assert time.monotonic() < deadline, "the background writer never wrote"
            time.sleep(0.02)
        src.run("echo last > /w/closed").check()
        clones = src.clone(2)
        for c in clones:
            assert c.read_file("/w/closed") == b"last\n"
            assert c.read_file("/w/open") == b"held\n"
            assert c.read_file("/w/mapped")[:7] == b"mapped!"
            assert c.run("head -c 7 /w/mapped; cat /w/closed").stdout == b"mapped!last\n"
