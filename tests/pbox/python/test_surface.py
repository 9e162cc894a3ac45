"""pbox.Client and pbox.aio.Client (and their Session, Sandbox, ExecProcess) offer the same
methods with the same parameters (no agent)."""

from __future__ import annotations

import inspect
from typing import Dict

import pytest

import pbox
import pbox.aio

# What only one flavour has, because blocking and asyncio code differ there: an asyncio session
# opens in `async with` or open() (a blocking one when made); a blocking command's output is
# iterated (stdout_iter, cancel), an asyncio one's read.
ONLY_BLOCKING = {"ExecProcess": {"cancel", "stdout_iter"}}
ONLY_ASYNCIO = {"Session": {"open"}, "ExecProcess": {"read"}}


def public_methods(cls: type) -> Dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in inspect.getmembers(cls, callable)
            if not name.startswith("_")}


def blocking_form(sig: inspect.Signature) -> inspect.Signature:
    """An asyncio method's signature as the blocking one's reads: an AsyncIterator result
    (an async generator, such as iter_read) is an Iterator there."""
    ret = sig.return_annotation
    if isinstance(ret, str) and ret.startswith("AsyncIterator["):
        sig = sig.replace(return_annotation=ret[len("Async"):])
    return sig


@pytest.mark.parametrize("name", ["Client", "Session", "Sandbox", "ExecProcess"])
def test_same_methods_and_signatures(name: str) -> None:
    blocking = public_methods(getattr(pbox, name))
    asyncio = public_methods(getattr(pbox.aio, name))
    assert set(blocking) - set(asyncio) == ONLY_BLOCKING.get(name, set())
    assert set(asyncio) - set(blocking) == ONLY_ASYNCIO.get(name, set())
    for method in set(blocking) & set(asyncio):
        assert blocking[method] == blocking_form(asyncio[method]), f"{name}.{method}"


@pytest.mark.parametrize("name", ["Client", "Session", "Sandbox", "ExecProcess"])
def test_asyncio_methods_are_coroutines(name: str) -> None:
    blocking = getattr(pbox, name)
    asyncio = getattr(pbox.aio, name)
    for method in public_methods(asyncio):
        if method == "session":  # made at once; opened by `async with`
            continue
        fn = getattr(asyncio, method)
        assert inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn), \
            f"{name}.{method}"
        if hasattr(blocking, method):
            assert not inspect.iscoroutinefunction(getattr(blocking, method)), f"{name}.{method}"


def test_shared_methods_bind_like_the_originals() -> None:
    with pytest.raises(TypeError, match="listdir"):
        pbox.Sandbox.listdir(object(), "/", "extra")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="run"):
        pbox.aio.Sandbox.run(object(), ["true"], "positional env")  # type: ignore[call-arg]
