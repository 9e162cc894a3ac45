"""TCP endpoints with a bearer token: the right token works; a missing, wrong or another agent's
token gets Unauthenticated and no data."""

from __future__ import annotations

import asyncio

import pytest

import pbox
import pbox.aio

TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-fedcba9876543210"


@pytest.fixture
def tcp_agents(make_agent):
    return make_agent(tcp_token=TOKEN_A), make_agent(tcp_token=TOKEN_B)


def test_right_token_works(tcp_agents, monkeypatch) -> None:
    a, _ = tcp_agents
    with pbox.Client(a.tcp_endpoint, token=TOKEN_A) as c:
        assert c.health().serving
        with c.session() as s:
            sb = s.create()
            sb.write_file("/tmp/secret", b"s3cret")
            assert sb.run(["cat", "/tmp/secret"]).stdout == b"s3cret"
            assert sb.read_file("/tmp/secret") == b"s3cret"
    monkeypatch.setenv("PBOX_TOKEN_FILE", str(a.token_file))
    monkeypatch.setenv("PBOX_ENDPOINT", a.tcp_endpoint)
    monkeypatch.delenv("PBOX_TOKEN", raising=False)
    with pbox.Client() as c:
        assert c.info().live_sandboxes == 0


def test_bad_tokens_are_unauthenticated_and_get_no_data(tcp_agents, monkeypatch) -> None:
    a, b = tcp_agents
    monkeypatch.delenv("PBOX_TOKEN", raising=False)
    monkeypatch.delenv("PBOX_TOKEN_FILE", raising=False)
    with a.client() as owner:  # unix socket: no token needed
        sb = owner.create()
        sb.write_file("/tmp/secret", b"s3cret")
        for token in (None, "wrong-token-0123456789", TOKEN_B, TOKEN_A + "x", TOKEN_A[:-1]):
            with pbox.Client(a.tcp_endpoint, token=token) as c:
                for call in (c.info, c.health, c.list, lambda: c.get(sb.id), c.create,
                             lambda: c.destroy(sb.id)):
                    with pytest.raises(pbox.Unauthenticated):
                        call()
                bad = pbox.Sandbox(c, sb.info)
                with pytest.raises(pbox.Unauthenticated):
                    bad.read_file("/tmp/secret")
                with pytest.raises(pbox.Unauthenticated):
                    bad.run(["cat", "/tmp/secret"])
                with pytest.raises(pbox.Unauthenticated):
                    bad.exec(["cat", "/tmp/secret"]).communicate()
                with pytest.raises(pbox.Unauthenticated):
                    bad.write_file("/tmp/secret", b"overwritten")
                with pytest.raises(pbox.Unauthenticated):
                    bad.listdir("/tmp")
                with pytest.raises(pbox.Unauthenticated):
                    c.session()
        assert sb.read_file("/tmp/secret") == b"s3cret"
        assert [x.id for x in owner.list()] == [sb.id]


def test_aio_tcp_tokens(tcp_agents) -> None:
    a, _ = tcp_agents

    async def main() -> None:
        async with pbox.aio.Client(a.tcp_endpoint, token=TOKEN_A) as c:
            async with c.session() as s:
                sb = await s.create()
                assert (await sb.run("echo hi")).stdout == b"hi\n"
        async with pbox.aio.Client(a.tcp_endpoint, token=TOKEN_B) as c:
            with pytest.raises(pbox.Unauthenticated):
                await c.list()
            with pytest.raises(pbox.Unauthenticated):
                await c.session().open()

    asyncio.run(main())
