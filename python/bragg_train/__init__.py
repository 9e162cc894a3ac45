"""bragg_train: bragg-train's trainer from Python (src/train, docs/train.md).

GRPO/PPO and supervised steps on packed THD batches over the engine's own model code, with the
fused linear cross-entropy, the chunked AdamW and data parallelism of the ``bragg-train`` command,
in process: the same C++ trainer (``bragg_train._core``), so that a step here and a step of the
command on the same trajectories and options give the same weights, bit for bit.

A trajectory is a dict with the fields of the command's JSONL lines::

    {"id": "r1", "group": "prompt-7",          # GRPO group: the rollouts of one prompt
     "tokens": [...],                          # the ids the engine saw and produced
     "loss_mask": [0, 0, 1, 1, ...],           # 1 on sampled tokens, 0 on prompt and tool output
     "logprobs": [...],                        # the engine's output_token_logprobs per token
     "versions": [...],                        # optional: version per token (-1: not sampled)
     "reward": 1.0,                            # or "advantage": given as is
     "routed_experts": ...}                    # optional, MoE: [tokens - 1, moe layers, top_k]

Arrays may be lists or numpy arrays; integer fields take integers only. A bad trajectory raises
ValueError naming it and the field, and nothing of its batch is trained::

    import bragg_train
    trainer = bragg_train.Trainer("model/", lr=1e-5, deterministic=True, threads=2)
    metrics = trainer.step(batch)          # dict: the keys of a `bragg-train --metrics` line
    trainer.save_model("out/")             # a Hugging Face directory bragg-engine loads
    trainer.save_checkpoint("ckpt/")       # ckpt/step-N and ckpt/latest
    trainer = bragg_train.Trainer.resume("ckpt/", lr=1e-5, deterministic=True, threads=2)
    trainer.close()                        # or: with bragg_train.Trainer(...) as trainer:

**Its own process.** By default a Trainer runs in a child process of its own
(``python -m bragg_train._worker``), and this package never loads the trainer's libtorch
(Debian's 1.13) into the caller's process: two libtorch builds in one process crash, and an RL
loop's process usually holds PyPI's torch. Batches go to the child pickled, answers come back
the same way; the caller's threads run meanwhile, and a crash of the trainer is a RuntimeError
here, not the end of the caller. The child runs this interpreter (``sys.executable``), or
``$BRAGG_TRAIN_PYTHON`` where set: the interpreter the extension was built for, when the caller's
cannot load it (a build tree's extension, made for Debian's Python and NumPy 1, called from an
environment with NumPy 2). ``Trainer(..., in_process=True)`` loads it here instead (no
copies; for processes that never import another torch): it refuses when PyPI's torch is
already imported, and afterwards ``import torch`` raises ImportError rather than crashing. In
process, every call releases the GIL while the trainer computes. Either way, a trainer shared
by threads serves them one call at a time.

Options are TrainOptions' fields (``bragg_train.options_defaults()``; docs/train.md), given by
name; an unknown one is a TypeError.
"""

from __future__ import annotations

import importlib.abc
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Dict, Iterable, List, Mapping, Optional

from ._wire import pack, unpack

__all__ = ["Trainer", "group_advantages", "options_defaults", "read_trajectories",
           "use_known_blas_core"]


def _child_env() -> Dict[str, str]:
    """The environment of a child that imports this very package, wherever it came from."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


_blas_checked = False


def use_known_blas_core() -> None:
    """For a program that will hold the trainer in its own process (``in_process=True``): call
    it first, before numpy or anything else loads OpenBLAS. On a CPU newer than the system's
    OpenBLAS it sets OPENBLAS_CORETYPE as bragg-train and bragg-engine set it for themselves
    (docs/engine.md, "CPUs newer than OpenBLAS"), so that the trainer here computes with their
    kernels, bit for bit, and not OpenBLAS's slow fallback. OpenBLAS reads the variable once,
    when a process first loads it: a trainer in its own process (the default) needs none of
    this."""
    _use_known_blas_core(os.environ.get("BRAGG_TRAIN_PYTHON") or sys.executable)


def _use_known_blas_core(python: str) -> None:
    """Sets OPENBLAS_CORETYPE in this process's environment, before any process here loads the
    trainer, where the C++ programs would set it (common/blas_core.h): the extension's OpenBLAS
    picks its kernels when it is loaded, falls back to slow Prescott ones on CPUs newer than it,
    and the trainer here must compute with the kernels bragg-train and bragg-engine use, or
    their results differ in the last bits. Asked once, in a process of its own."""
    global _blas_checked
    if _blas_checked or "OPENBLAS_CORETYPE" in os.environ:
        return
    probe = subprocess.run(
        [python, "-c", "import bragg_train._core as c; print(c.known_blas_core())"],
        env=_child_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        raise RuntimeError(f"bragg_train's extension did not load in {python}: "
                           f"{probe.stderr.strip()[-2000:]}")
    core = probe.stdout.strip()
    if core:
        os.environ["OPENBLAS_CORETYPE"] = core
    _blas_checked = True


class _Worker:
    """A child process running bragg_train._worker, and the connection to it."""

    def __init__(self):
        parent, child = socket.socketpair()
        python = os.environ.get("BRAGG_TRAIN_PYTHON") or sys.executable
        try:
            _use_known_blas_core(python)
        except BaseException:
            parent.close()
            child.close()
            raise
        env = _child_env()
        try:
            self._proc = subprocess.Popen(
                [python, "-m", "bragg_train._worker", str(child.fileno())],
                pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env)
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._lock = threading.Lock()
        self._dead: Optional[str] = None

    def request(self, op: str, *args: Any) -> Any:
        with self._lock:
            if self._dead:
                raise RuntimeError(self._dead)
            try:
                self._conn.send((op, pack(args)))
                status, value = self._conn.recv()
            except (EOFError, OSError):
                try:
                    code = self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:  # its end of the socket broke, yet it runs
                    self._proc.kill()
                    code = self._proc.wait()
                how = f"signal {-code}" if code < 0 else f"code {code}"
                self._dead = f"the trainer's process ended ({how}) during {op}"
                raise RuntimeError(self._dead) from None
        if status == "err":
            raise value
        return unpack(value)

    def close(self) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = "the trainer was closed"
                try:
                    self._conn.send(("close", ()))
                    self._conn.recv()
                except (EOFError, OSError):
                    pass
            self._conn.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class _InProcess:
    """The extension loaded in this process."""

    def __init__(self):
        self._core = _load_core()
        self._t = None

    def request(self, op: str, *args: Any) -> Any:
        from ._worker import defaults, options
        if op == "defaults":
            return defaults()
        if op not in ("create", "resume") and self._t is None:
            raise RuntimeError("the trainer was closed")
        if op == "create":
            self._t = self._core.Trainer.create(options(args[0]))
        elif op == "resume":
            self._t = self._core.Trainer.resume(args[0], options(args[1]))
        elif op == "call":
            return getattr(self._t, args[0])(*args[1])
        elif op == "get":
            value = getattr(self._t, args[0])
            if args[0] == "options":
                value = {n: getattr(value, n) for n in options_defaults()}
            return value
        elif op == "set":
            setattr(self._t, args[0], args[1])
        elif op == "close":
            self._t = None
        return None

    def close(self) -> None:
        self._t = None


class _RefuseTorch(importlib.abc.MetaPathFinder):
    """Once the trainer's libtorch is in this process, `import torch` would load a second one
    and crash: refuse it with a message instead."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(
                "bragg_train is loaded in this process (Trainer(in_process=True)) with its own "
                "libtorch; another torch cannot be loaded beside it. Use bragg_train.Trainer "
                "without in_process=True (its own process), or import torch in another process.")
        return None


_core_lock = threading.Lock()


def _load_core():
    with _core_lock:
        if "bragg_train._core" not in sys.modules:
            torch = sys.modules.get("torch")
            if torch is not None:
                raise ImportError(
                    f"torch {getattr(torch, '__version__', '?')} is already loaded in this "
                    "process; bragg_train's trainer carries its own libtorch and cannot be "
                    "loaded beside it: use bragg_train.Trainer without in_process=True")
            _use_known_blas_core(sys.executable)
            sys.meta_path.insert(0, _RefuseTorch())
        from . import _core
        return _core


_helper: Optional[_Worker] = None
_helper_lock = threading.Lock()


def _stateless(op: str, *args: Any) -> Any:
    """A request that needs no trainer: in this process when the extension is already here,
    else in one helper process shared by the module's functions."""
    global _helper
    if "bragg_train._core" in sys.modules:
        core = sys.modules["bragg_train._core"]
        if op == "defaults":
            from ._worker import defaults
            return defaults()
        return getattr(core, op)(*args)
    with _helper_lock:
        if _helper is None or _helper._dead:
            _helper = _Worker()
        helper = _helper
    return helper.request(op, *args)


_defaults: Optional[Dict[str, Any]] = None


def options_defaults() -> Dict[str, Any]:
    """Every trainer option's name and default, as the C++ TrainOptions has them."""
    global _defaults
    if _defaults is None:
        _defaults = _stateless("defaults")
    return dict(_defaults)


def _checked(kwargs: Dict[str, Any], known: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    known = known if known is not None else options_defaults()
    out = {}
    for name, value in kwargs.items():
        if name not in known:
            raise TypeError(f"unknown trainer option {name!r} "
                            "(bragg_train.options_defaults() has them all)")
        out[name] = os.fspath(value) if isinstance(value, os.PathLike) else value
    return out


def read_trajectories(path: "str | os.PathLike[str]") -> List[Dict[str, Any]]:
    """A JSONL file of trajectories (bragg-train's format) as a batch of dicts with numpy
    arrays; FileNotFoundError, or ValueError naming file:line."""
    return _stateless("read_trajectories", os.fspath(path))


def group_advantages(batch: Iterable[Mapping[str, Any]], normalize_std: bool = True) -> Any:
    """GRPO's group-relative advantage of each trajectory (numpy float64), as a step takes it:
    (reward - group mean) / (group std + 1e-6), or without the std (Dr. GRPO); an explicit
    "advantage" is kept."""
    return _stateless("group_advantages", _as_list(batch), normalize_std)


class Trainer:
    """One trainer: the model, its optimizer state and its step count (trainer.h).

    ``Trainer(model_dir, **options)`` loads a Hugging Face directory (what bragg-engine serves)
    in a process of its own (``in_process=True``: in this one). With ``world_size`` > 1 every
    rank constructs its trainer with its ``rank`` and the same ``rendezvous`` ("file:PATH" or
    "tcp:HOST:PORT") and is given the same batches; the constructor returns once every rank has
    joined. ``close()`` (or leaving a ``with`` block) ends the trainer's process.
    """

    def __init__(self, model_dir: "str | os.PathLike[str]", *, in_process: bool = False,
                 **kwargs: Any):
        self._start(in_process, "create", None, dict(kwargs, model_dir=model_dir))

    @classmethod
    def resume(cls, checkpoint_dir: "str | os.PathLike[str]", *, in_process: bool = False,
               **kwargs: Any) -> "Trainer":
        """Continues from ``checkpoint_dir/latest`` (save_checkpoint's): the next steps are bit
        for bit those of the run that wrote it, given the same options."""
        self = cls.__new__(cls)
        self._start(in_process, "resume", os.fspath(checkpoint_dir), kwargs)
        return self

    def _start(self, in_process: bool, op: str, where: Optional[str],
               kwargs: Dict[str, Any]) -> None:
        global _defaults
        self._lock = threading.Lock()
        self._b = _InProcess() if in_process else _Worker()
        try:
            # The option names come from the trainer's own process (no second one for them).
            if _defaults is None:
                _defaults = self._b.request("defaults")
            opts = _checked(kwargs, _defaults)
            self._b.request(op, *((where, opts) if where is not None else (opts,)))
        except BaseException:
            self._b.close()
            raise

    def _call(self, name: str, *args: Any) -> Any:
        with self._lock:
            return self._b.request("call", name, args)

    def step(self, batch: Iterable[Mapping[str, Any]]) -> Dict[str, Any]:
        """One training step (``minibatches`` optimizer steps) on ``batch``; its metrics."""
        return self._call("step", _as_list(batch))

    def logprobs(self, batch: Iterable[Mapping[str, Any]]) -> List[Any]:
        """The current policy's log-prob of every token given its prefix (index 0: 0), one
        float32 array per trajectory, computed on the packed batch as ``step`` does."""
        return self._call("logprobs", _as_list(batch))

    def routed_experts(self, batch: Iterable[Mapping[str, Any]]) -> List[Any]:
        """The experts the current policy routes each position but the last to, one int32 array
        per trajectory, flat ``[tokens - 1, moe layers, top_k]`` (empty for a dense model)."""
        return self._call("routed_experts", _as_list(batch))

    def save_model(self, directory: "str | os.PathLike[str]") -> None:
        """The current weights as a Hugging Face directory, published atomically."""
        self._call("save_model", os.fspath(directory))

    def save_checkpoint(self, root: "str | os.PathLike[str]") -> None:
        """``root/step-N`` (model, optimizer, step, version) and ``root/latest`` pointing at it."""
        self._call("save_checkpoint", os.fspath(root))

    def save_gradients(self, batch: Iterable[Mapping[str, Any]],
                       path: "str | os.PathLike[str]") -> None:
        """The objective's gradient on ``batch`` as FP32 safetensors named as the model's
        parameters; no optimizer step is taken."""
        self._call("save_gradients", _as_list(batch), os.fspath(path))

    def set_lr(self, lr: float) -> None:
        self._call("set_lr", lr)

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        with self._lock:
            return self._b.request("get", "steps")

    @property
    def version(self) -> int:
        """The weights' version: one more per step; settable (an RL loop's own numbering)."""
        with self._lock:
            return self._b.request("get", "version")

    @version.setter
    def version(self, v: int) -> None:
        with self._lock:
            self._b.request("set", "version", v)

    @property
    def options(self) -> Dict[str, Any]:
        """The options this trainer runs with, by name."""
        with self._lock:
            return self._b.request("get", "options")

    def close(self) -> None:
        """Ends the trainer (and its process); later calls raise RuntimeError."""
        b = getattr(self, "_b", None)
        if b is not None:
            b.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def _as_list(batch: Iterable[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    if isinstance(batch, (dict, str, bytes)):
        raise TypeError("a batch is a sequence of trajectory dicts, not a single one")
    return batch if isinstance(batch, list) else list(batch)
