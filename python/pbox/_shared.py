"""The methods the blocking client (:mod:`pbox.client`) and the asyncio client (:mod:`pbox.aio`)
share, written once (not public API).

Each method here is a generator: it yields a zero-argument callable for every call it makes
(a gRPC call, or a public method of the same client) and is sent back that call's result, or
thrown its exception. :func:`blocking` turns a table of such methods into plain methods that run
each call as it comes (no event loop, nothing shared between threads); :func:`asynchronous` into
coroutine methods that await each. Both keep the method's name, signature and docstring, so a
method cannot exist in one client and not the other, nor take other arguments there.

In the methods, ``self._client`` is a client of the flavour being built and its ``_Sandbox`` is
that flavour's Sandbox class.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import IO, Any, Callable, Dict, Generator, List, Mapping, Optional, Union

import grpc

from . import _common as c
from . import images as im
from ._proto import pbox_pb2 as pb
from .errors import NotFound
from .types import AgentInfo, FileInfo, Health, RunResult, SandboxInfo

_SAME = object()


def docs(aio: Any = _SAME) -> Callable[[Callable], Callable]:
    """The asyncio method's docstring when it is not the blocking one's (None: none)."""

    def mark(fn: Callable) -> Callable:
        fn.__aio_doc__ = aio  # type: ignore[attr-defined]
        return fn

    return mark


def _unary(client: Any, method: str, request: Any, deadline: bool = True) -> Callable[[], Any]:
    return functools.partial(client._unary, method, request, deadline)


def _run(gen: Generator) -> Any:
    try:
        step = next(gen)
        while True:
            try:
                value = step()
            except BaseException as e:
                step = gen.throw(e)
            else:
                step = gen.send(value)
    except StopIteration as stop:
        return stop.value


async def _arun(gen: Generator) -> Any:
    try:
        step = next(gen)
        while True:
            try:
                value = await step()
            except BaseException as e:
                step = gen.throw(e)
            else:
                step = gen.send(value)
    except StopIteration as stop:
        return stop.value


def _wrap(fn: Callable, is_async: bool, module: str, owner: str) -> Callable:
    """A method with ``fn``'s exact parameters (so calls bind, and fail, as ``fn``'s would)
    that drives ``fn``'s generator."""
    sig = inspect.signature(fn)
    params: List[str] = []
    args: List[str] = []
    namespace: Dict[str, Any] = {"_fn": fn, "_run": _run, "_arun": _arun}
    star = False
    for i, p in enumerate(sig.parameters.values()):
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text, star = "*" + p.name, True
            args.append(text)
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + p.name
            args.append(text)
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                params.append("*")
                star = True
            args.append(p.name if p.kind is not p.KEYWORD_ONLY else f"{p.name}={p.name}")
        if p.default is not p.empty:
            namespace[f"_d{i}"] = p.default
            text += f"=_d{i}"
        params.append(text)
    call = f"_fn({', '.join(args)})"
    if is_async:
        src = f"async def {fn.__name__}({', '.join(params)}):\n    return await _arun({call})\n"
    else:
        src = f"def {fn.__name__}({', '.join(params)}):\n    return _run({call})\n"
    exec(src, namespace)  # noqa: S102 -- a wrapper of a fixed shape, as dataclasses makes them
    method = namespace[fn.__name__]
    method.__annotations__ = dict(fn.__annotations__)
    method.__module__ = module
    method.__qualname__ = f"{owner}.{fn.__name__}"
    doc = fn.__doc__
    if is_async and getattr(fn, "__aio_doc__", _SAME) is not _SAME:
        doc = fn.__aio_doc__  # type: ignore[attr-defined]
    method.__doc__ = doc
    return method


def _build(table: type, is_async: bool, module: str, owner: str) -> type:
    methods = {name: _wrap(fn, is_async, module, owner) for name, fn in vars(table).items()
               if inspect.isgeneratorfunction(fn)}
    return type(f"_{owner}Shared", (), {"__module__": module, "__slots__": (), **methods})


def blocking(table: type, module: str, owner: str) -> type:
    """A base class for the blocking ``owner`` class with every method of ``table``."""
    return _build(table, False, module, owner)


def asynchronous(table: type, module: str, owner: str) -> type:
    """A base class for the asyncio ``owner`` class with every method of ``table``."""
    return _build(table, True, module, owner)


# ---- the tables ----
# Docstrings are the blocking client's; @docs(aio=...) gives the asyncio one where it differs.


class ClientMethods:
    @docs(aio=None)
    def info(self) -> AgentInfo:
        """The agent's version, CPU set, limits and defaults."""
        return c.agent_info((yield _unary(self, "Info", pb.InfoRequest())))

    @docs(aio=None)
    def health(self) -> Health:
        """Whether the agent serves, and how many sandboxes it holds."""
        return c.health((yield _unary(self, "Health", pb.HealthRequest())))

    # ---- images ----

    def import_image(self, name: str, path: Union[str, os.PathLike, IO[bytes]],
                     ref: str = "") -> im.ImageInfo:
        """Imports a root filesystem tarball (plain, gzip or zstd), a ``docker save`` /
        ``podman save`` archive or an OCI image layout (``podman save --format oci-archive``,
        or a layout directory), read from a local path or a binary file object, as image
        ``name`` (replacing an imported image of that name). ``ref`` picks one image of an
        archive holding several (a tag such as ``name:tag``, or an OCI manifest digest
        ``sha256:...``); without it such an archive is refused with the list of its images.
        Layers the agent's node already has are reused. Raises InvalidArgument for a hostile
        or malformed archive (the message names the entry), ResourceExhausted past the
        agent's ``--max-image-bytes``."""
        try:
            return im.image_info((yield lambda: self._stub.ImportImage(
                im.import_requests(name, path, ref), metadata=self._md)))
        except grpc.RpcError as e:
            raise self._error(e, "ImportImage") from None

    def list_images(self) -> List[im.ImageInfo]:
        """Every image of the agent: "host", its ``--image`` directories, imported ones."""
        resp = yield _unary(self, "ListImages", pb.ListImagesRequest())
        return [im.image_info(i) for i in resp.images]

    def remove_image(self, name: str) -> None:
        """Removes an imported image (its layers stay until :meth:`prune_images`). Raises
        NotFound, or FailedPrecondition while a sandbox uses it."""
        yield _unary(self, "RemoveImage", pb.RemoveImageRequest(name=name))

    def prune_images(self) -> im.PruneResult:
        """Deletes the layers that no image and no live sandbox uses."""
        return im.prune_result(
            (yield _unary(self, "PruneImages", pb.PruneImagesRequest(), deadline=False)))

    # ---- sandboxes ----

    @docs(aio=None)
    def list(self, session_id: Optional[str] = None) -> List[SandboxInfo]:
        """Every sandbox of the agent, or only those of ``session_id``."""
        resp = yield _unary(self, "ListSandboxes",
                            pb.ListSandboxesRequest(session_id=session_id or ""))
        return [c.sandbox_info(s) for s in resp.sandboxes]

    @docs(aio=None)
    def get(self, sandbox_id: str) -> "Sandbox":
        """A handle on an existing sandbox. Raises NotFound if there is none with that id."""
        resp = yield _unary(self, "GetSandbox", pb.GetSandboxRequest(sandbox_id=sandbox_id))
        return self._Sandbox(self, c.sandbox_info(resp))

    @docs(aio="A detached sandbox (see :meth:`pbox.Client.create`).")
    def create(self, image: str = "host", cpus: int = 1, memory: c.Size = None,
               disk: c.Size = None, pids: Optional[int] = None,
               env: Optional[Mapping[str, str]] = None, workdir: Optional[str] = None,
               idle_ttl: Optional[float] = None, labels: Optional[Mapping[str, str]] = None,
               runtime: Optional[str] = None, cpu_quota: Optional[float] = None) -> "Sandbox":
        """Creates a detached sandbox: it lives until ``destroy()`` or ``idle_ttl`` seconds
        without a call (default: the agent's ``--detached-ttl``). Arguments as in
        :meth:`Session.create`."""
        spec = c.build_spec(image, cpus, memory, disk, pids, env, workdir, idle_ttl, labels,
                            runtime, cpu_quota)
        return (yield lambda: self._create("", spec))

    def _create(self, session_id: str, spec: pb.SandboxSpec) -> "Sandbox":
        resp = yield _unary(self, "CreateSandbox",
                            pb.CreateSandboxRequest(session_id=session_id, spec=spec))
        return self._Sandbox(self, c.sandbox_info(resp))

    @docs(aio=None)
    def destroy(self, sandbox_id: str) -> None:
        """Destroys a sandbox and everything running in it. Raises NotFound if it is gone."""
        yield _unary(self, "DestroySandbox", pb.DestroySandboxRequest(sandbox_id=sandbox_id))


class SessionMethods:
    @docs(aio="A sandbox owned by this session; arguments as :meth:`pbox.Session.create`.")
    def create(self, image: str = "host", cpus: int = 1, memory: c.Size = None,
               disk: c.Size = None, pids: Optional[int] = None,
               env: Optional[Mapping[str, str]] = None, workdir: Optional[str] = None,
               idle_ttl: Optional[float] = None, labels: Optional[Mapping[str, str]] = None,
               runtime: Optional[str] = None, cpu_quota: Optional[float] = None) -> "Sandbox":
        """Creates a sandbox owned by this session.

        Args:
            image: image name; "host" is a read-only view of the host's /usr.
            cpus: CPUs of the agent's sandbox CPU set to pin to.
            memory: memory limit (processes and writable layer), int bytes or "512M"/"1G";
                None: the agent's default.
            disk: size of the writable layer, as ``memory``.
            pids: process/thread limit; None: the agent's default.
            env: default environment of every command.
            workdir: default cwd of every command (created if missing); default "/".
            idle_ttl: destroy after this many seconds without a call; None: never.
            labels: free-form labels, shown by ``list()``.
            runtime: runtime name; None: the agent's default.
            cpu_quota: CPU bandwidth limit in CPUs (e.g. 0.5); None: no quota.

        Raises:
            ValueError: a bad size or argument (before anything is sent).
            ResourceExhausted: the agent is at its sandbox limit.
            InvalidArgument: the agent refused the spec (unknown image, too much memory...).
            SessionClosed: the session has ended.
        """
        self._check_open()
        spec = c.build_spec(image, cpus, memory, disk, pids, env, workdir, idle_ttl, labels,
                            runtime, cpu_quota)
        return (yield lambda: self._client._create(self._id, spec))

    @docs(aio=None)
    def list(self) -> List[SandboxInfo]:
        """The live sandboxes of this session."""
        return (yield lambda: self._client.list(self._id))


class SandboxMethods:
    @docs(aio=None)
    def refresh(self) -> SandboxInfo:
        """Fetches the sandbox's current state (``info`` is updated)."""
        self.info = (yield lambda: self._client.get(self.id)).info
        return self.info

    # ---- commands ----

    @docs(aio="Runs a command to completion; see :meth:`pbox.Sandbox.run`.")
    def run(self, argv: c.Argv, *, env: Optional[Mapping[str, str]] = None,
            cwd: Optional[str] = None, timeout: Optional[float] = None,
            stdin: Union[bytes, str, None] = None, max_output: c.Size = None) -> RunResult:
        """Runs a command to completion and returns its buffered output and result.

        Args:
            argv: a list of arguments (argv[0] looked up in PATH), or a str run by ``sh -c``.
            env: merged over the sandbox's environment.
            cwd: working directory; default the sandbox's workdir.
            timeout: seconds; at expiry the whole process tree is killed (``timed_out``).
            stdin: bytes or str fed to the command (at most ~15 MiB; use :meth:`exec` for
                more); None: /dev/null.
            max_output: per-stream cap (default 1 MiB, at most 4 MiB); longer output keeps
                its head and tail and sets ``stdout_truncated``/``stderr_truncated``.

        A command that fails is not an exception: check ``result.ok`` or call
        ``result.check()``. Raises NotFound if the sandbox is gone.
        """
        req, args = c.run_request(self.id, argv, env, cwd, timeout, stdin, max_output)
        resp = yield _unary(self._client, "Run", req, deadline=False)
        return c.run_result(resp.result, resp.stdout, resp.stderr, args)

    # ---- files ----

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (yield lambda: self.read_file(path)).decode(encoding)

    @docs(aio=None)
    def listdir(self, path: str = "/") -> List[FileInfo]:
        """Entries of a directory, sorted by name (``path`` of each is the entry name)."""
        resp = yield _unary(self._client, "ListDir", pb.ListDirRequest(sandbox_id=self.id,
                                                                       path=path))
        return [c.file_info(e) for e in resp.entries]

    @docs(aio=None)
    def stat(self, path: str) -> FileInfo:
        """Info about ``path`` (symlinks are not followed). Raises NotFound."""
        return c.file_info(
            (yield _unary(self._client, "Stat", pb.StatRequest(sandbox_id=self.id, path=path))))

    def exists(self, path: str) -> bool:
        try:
            yield lambda: self.stat(path)
            return True
        except NotFound:
            return False

    @docs(aio=None)
    def mkdir(self, path: str, mode: int = 0o755, parents: bool = True) -> FileInfo:
        """Creates a directory (with its parents unless ``parents=False``)."""
        c.check_mode(mode)
        return c.file_info((yield _unary(
            self._client, "MakeDir",
            pb.MakeDirRequest(sandbox_id=self.id, path=path, mode=mode, parents=parents))))

    @docs(aio=None)
    def remove(self, path: str, recursive: bool = False) -> None:
        """Removes a file, or a directory (its contents too when ``recursive``)."""
        yield _unary(self._client, "Remove",
                     pb.RemoveRequest(sandbox_id=self.id, path=path, recursive=recursive))

    @docs(aio=None)
    def move(self, src: str, dst: str, no_replace: bool = False) -> FileInfo:
        """Renames ``src`` to ``dst``; with ``no_replace`` raises AlreadyExists if dst exists."""
        return c.file_info((yield _unary(
            self._client, "Move",
            pb.MoveRequest(sandbox_id=self.id, src=src, dst=dst, no_replace=no_replace))))

    # ---- lifetime ----

    @docs(aio="Clones this sandbox ``n`` times; see :meth:`pbox.Sandbox.clone`.")
    def clone(self, n: int = 1, *, cpus: Optional[int] = None, memory: c.Size = None,
              disk: c.Size = None, pids: Optional[int] = None,
              env: Optional[Mapping[str, str]] = None, workdir: Optional[str] = None,
              idle_ttl: Optional[float] = None, labels: Optional[Mapping[str, str]] = None,
              cpu_quota: Optional[float] = None) -> List["Sandbox"]:
        """Starts ``n`` new sandboxes over a frozen copy of this sandbox's files (its
        writable layer, stacked read-only above its image): files written or deleted here so
        far are there, processes are not. Each clone has its own writable layer; this
        sandbox runs on unchanged. The clones have this sandbox's spec where an argument is
        ``None`` and join its session (or are detached like it). All or nothing: raises
        ResourceExhausted, creating none, if ``n`` more sandboxes do not fit the agent."""
        req = c.clone_request(self.id, n, cpus, memory, disk, pids, env, workdir, idle_ttl,
                              labels, cpu_quota)
        resp = yield _unary(self._client, "CloneSandbox", req, deadline=False)
        return [self._client._Sandbox(self._client, c.sandbox_info(s)) for s in resp.sandboxes]

    @docs(aio=None)
    def destroy(self, missing_ok: bool = False) -> None:
        """Destroys the sandbox; raises NotFound if it is already gone unless ``missing_ok``."""
        try:
            yield lambda: self._client.destroy(self.id)
        except NotFound:
            if not missing_ok:
                raise
