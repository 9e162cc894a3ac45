"""Environments for bragg-rl written in Python: the tool server and the verifier from one class.

bragg-rl runs a task's environment as two commands in each rollout's sandbox (docs/rl.md "Tool
protocol"): a long-lived tool server, fed one JSON line per model turn on stdin and answering one
JSON line, and a verifier, given the finished rollout as JSON on stdin and printing its reward.
This module writes both protocols; an environment is a subclass of ``Environment``:

    from env import Done, Environment, Observation, main   # env.py copied next to this file

    class Echo(Environment):
        def reset(self):                        # optional: before the first turn
            self.turns = 0
        def step(self, text):                   # the model's turn, its final "\\n" included
            self.turns += 1
            if text.startswith("answer"):
                return Done()
            return Observation(text.upper(), tool="upper")
        def reward(self, rollout):              # in the verifier, on a fresh instance
            return float(rollout.done)

    if __name__ == "__main__":
        main(Echo)                              # my_env.py serve | my_env.py verify

and the config names the one file twice::

    [task]
    files = "task"                              # a directory holding my_env.py and env.py
    tool_server = ["python3", "/task/my_env.py", "serve"]
    verifier = ["python3", "/task/my_env.py", "verify"]

or once, with the tool server scoring the rollout too (a Python process fewer per rollout)::

    tool_server = ["python3", "/task/my_env.py", "serve"]
    verifier_in_tool_server = true

**Copy this file.** A sandbox sees only the files uploaded to ``/task`` (``task.files``), not the
bragg_rl package, so this module is one file, standard library only (Python 3.11), that works
when ``env.py`` alone is copied next to the user's script and imported as ``env``; it works as
well imported as ``bragg_rl.env``.

The tool server (``serve``): one instance of the environment for the server's life, which is
one rollout (bragg-rl starts a server per rollout, and a fresh one after a crash or a timeout).
Each request ``{"text": "..."}`` is answered with exactly one line, flushed:

- ``Observation(text, tool, error)`` -> ``{"observation": text, "tool": tool}`` (plus
  ``"error": true``); ``Done()`` -> ``{"done": true}``;
- a request that is not a JSON object with a string ``"text"`` ->
  ``{"observation": "error: bad request\\n", "error": true}``;
- an exception in ``step``, or a ``step`` that returns neither an ``Observation`` with string
  text and tool nor a ``Done`` -> ``{"observation": "error: <ExceptionType>\\n", "tool": "",
  "error": true}`` with the traceback on stderr; the server goes on with the next request, so
  the model sees an error and the rollout continues;
- ``{"verify": ROLLOUT}`` (``task.verifier_in_tool_server``; ROLLOUT as the verifier reads it)
  -> ``{"reward": x}`` from ``reward`` on a fresh instance, as ``verify`` computes it, or
  ``{"error": "<why>"}`` where ``verify`` would exit 1 or 2 (the trajectory is then dropped as
  ``verifier_failed``; the server goes on);
- end of input -> ``serve`` returns 0 (bragg-rl's start-up probe needs exit 0 on empty input).

An exception in the factory or in ``reset`` is not caught: the server exits 1 with the traceback,
so a broken environment refuses the run at bragg-rl's start-up probe instead of costing every
turn. While the environment's code runs, ``sys.stdout`` is redirected to stderr: a stray
``print`` cannot corrupt the protocol.

The verifier (``verify``): parses the rollout into ``Rollout``, calls ``reward`` on a fresh
instance (``reset`` is not called) and prints ``repr(float(reward))``. Exit status: 0; 1 when the
input is not a rollout or ``reward`` raises (message or traceback on stderr); 2 when the reward is
not a finite number (NaN, inf, None, a string). bragg-rl drops a trajectory whose verifier fails
(``verifier_failed``).

``run`` is unrelated to the sandbox: a convenience for Python programs that start a bragg-rl run
(``bragg-rl run CONFIG``) and want its summary.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple, Union

__all__ = [
    "Observation",
    "Done",
    "Rollout",
    "Environment",
    "serve",
    "verify",
    "main",
    "run",
]

BAD_REQUEST = {"observation": "error: bad request\n", "error": True}
RUN_DIR_DEFAULT = "rl-run"  # [run] dir's default (examples/rl-config.toml)
TAIL_LINES = 20  # lines of bragg-rl's output a RuntimeError from run() carries


@dataclasses.dataclass
class Observation:
    """What the model is shown after its turn: ``text`` (appended to the context, loss mask 0),
    the name of the ``tool`` that produced it, and whether it reports an ``error``."""

    text: str
    tool: str = ""
    error: bool = False


@dataclasses.dataclass
class Done:
    """The rollout is over: bragg-rl asks the model for no further turn."""


@dataclasses.dataclass
class Rollout:
    """A finished rollout, as the verifier receives it: the prompt and its meta (from the
    prompts file), the model's turns (each with its final stop string), the observations shown
    after them (one fewer than the turns when the rollout ended on a turn) and whether the tool
    server said ``Done``."""

    prompt: str
    meta: Dict[str, Any]
    turns: List[str]
    observations: List[str]
    done: bool

    @classmethod
    def from_json(cls, obj: Any) -> "Rollout":
        """Builds a Rollout from the verifier's parsed JSON. Raises ValueError naming the field
        that is missing or of the wrong type. ``meta`` missing or null is ``{}``, ``done``
        missing is False."""
        if not isinstance(obj, dict):
            raise ValueError(f"the rollout is not a JSON object but {type(obj).__name__}")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError('the rollout has no "prompt" string')
        meta = obj.get("meta")
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise ValueError('the rollout\'s "meta" is not a JSON object')
        lists = {}
        for key in ("turns", "observations"):
            value = obj.get(key)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f'the rollout\'s "{key}" is not a list of strings')
            lists[key] = value
        done = obj.get("done", False)
        if not isinstance(done, bool):
            raise ValueError('the rollout\'s "done" is not a boolean')
        return cls(prompt=prompt, meta=meta, turns=lists["turns"],
                   observations=lists["observations"], done=done)


class Environment:
    """A task's environment. Subclass it and override ``step`` and ``reward``; ``reset`` is
    optional. The constructor must take no arguments, or pass ``serve``/``verify``/``main`` a
    factory (``lambda: MyEnv(level=3)``). An instance is used by one thread."""

    def reset(self) -> None:
        """Called once before the first turn of the rollout this server serves."""

    def step(self, text: str) -> Union[Observation, Done]:
        """Answers the model's turn ``text`` (its final "\\n" included): an ``Observation``, or
        ``Done`` when the rollout is over. An exception becomes an error observation."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def reward(self, rollout: Rollout) -> float:
        """The finished rollout's reward, a finite number. Runs in the verifier process on a
        fresh instance: it must not depend on state from ``step``."""
        raise NotImplementedError(f"{type(self).__name__}.reward")


EnvFactory = Callable[[], Environment]


def _utf8_clean(text: str) -> str:
    # Lone surrogates (from surrogateescape'd input) would be written as \udcxx escapes, which
    # bragg-rl's JSON parser refuses: the whole reply would become "bad tool reply".
    return text.encode("utf-8", "replace").decode("utf-8")


def _reply(out: TextIO, obj: Dict[str, Any]) -> None:
    # ensure_ascii: the line is ASCII whatever the sandbox's locale; newlines inside strings are
    # escaped, so a reply is always exactly one line.
    out.write(json.dumps(obj, ensure_ascii=True) + "\n")
    out.flush()


def _read_lines(stdin: Any):
    # sys.stdin is read as bytes and decoded here, so that a sandbox's C locale or bytes that
    # are not UTF-8 cannot stop the loop.
    while True:
        line = stdin.readline()
        if not line:
            return
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        yield line


def _parse_request(line: str) -> Optional[Dict[str, Any]]:
    try:
        request = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None
    return request if isinstance(request, dict) else None


def _score(env_factory: EnvFactory, rollout: Rollout) -> Tuple[Optional[float], str, int]:
    """(reward, "", 0) for ``rollout`` scored by a fresh environment; else (None, why, status):
    status 1 for an exception in ``reward`` (its traceback printed on stderr), 2 for a reward
    that is not a finite number."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            reward = env_factory().reward(rollout)
    except Exception as e:  # noqa: BLE001 - reported, and bragg-rl drops the trajectory
        traceback.print_exc(file=sys.stderr)
        return None, f"reward raised {type(e).__name__}: {e}", 1
    x = _finite(reward)
    if x is None:
        return None, (f"reward returned {reward!r}, not a finite number; bragg-rl drops the "
                      f"trajectory (verifier_failed)"), 2
    return x, "", 0


NOT_A_ROLLOUT = "the input is not a rollout (docs/rl.md \"Tool protocol\")"


def _step_reply(env: Environment, text: str) -> Dict[str, Any]:
    result = env.step(text)
    if isinstance(result, Done):
        return {"done": True}
    if not isinstance(result, Observation):
        raise TypeError(f"step returned {type(result).__name__}, not Observation or Done")
    if not isinstance(result.text, str):
        raise TypeError(f"Observation.text is {type(result.text).__name__}, not str")
    if not isinstance(result.tool, str):
        raise TypeError(f"Observation.tool is {type(result.tool).__name__}, not str")
    reply: Dict[str, Any] = {"observation": _utf8_clean(result.text),
                             "tool": _utf8_clean(result.tool)}
    if result.error:
        reply["error"] = True
    return reply


def serve(env_factory: EnvFactory, stdin: Optional[TextIO] = None,
          stdout: Optional[TextIO] = None) -> int:
    """The tool server's loop (see the module's docstring): builds one environment, calls its
    ``reset``, then answers each line of ``stdin`` with one line on ``stdout`` until end of
    input, and returns 0. ``stdin``/``stdout`` default to the process's (``sys.stdin`` read as
    UTF-8 bytes, undecodable bytes replaced); any object with ``readline`` (str or bytes lines)
    and one with ``write``/``flush`` will do. Exceptions from the factory and ``reset``
    propagate; those from ``step`` are answered as error observations."""
    if stdin is None:
        stdin = getattr(sys.stdin, "buffer", sys.stdin)
    out = sys.stdout if stdout is None else stdout
    with contextlib.redirect_stdout(sys.stderr):
        env = env_factory()
        env.reset()
    for line in _read_lines(stdin):
        request = _parse_request(line)
        text = request.get("text") if request is not None else None
        if request is not None and "verify" in request:
            try:
                x, why, _ = _score(env_factory, Rollout.from_json(request["verify"]))
            except ValueError as e:
                x, why = None, f"{NOT_A_ROLLOUT}: {e}"
            if x is None:
                print(f"bragg_rl.env verify: {why}", file=sys.stderr)
                reply = {"error": _utf8_clean(why)}
            else:
                reply = {"reward": x}
        elif not isinstance(text, str):
            print(f"bragg_rl.env: bad request: {line[:200]!r}", file=sys.stderr)
            reply = BAD_REQUEST
        else:
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    reply = _step_reply(env, text)
            except Exception as e:  # noqa: BLE001 - any error in user code is the model's to see
                traceback.print_exc(file=sys.stderr)
                reply = {"observation": f"error: {type(e).__name__}\n", "tool": "",
                         "error": True}
        _reply(out, reply)
    sys.stderr.flush()
    return 0


def _finite(value: Any) -> Optional[float]:
    if isinstance(value, (str, bytes, bytearray)):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def verify(env_factory: EnvFactory, stdin: Optional[TextIO] = None,
           stdout: Optional[TextIO] = None) -> int:
    """The verifier (see the module's docstring): reads one rollout (JSON) from ``stdin``,
    prints its reward on ``stdout`` and returns the exit status: 0, 1 (input not a rollout, or
    an exception in the environment; traceback on stderr), 2 (a reward that is not a finite
    number). ``stdin``/``stdout`` default to the process's."""
    if stdin is None:
        stdin = getattr(sys.stdin, "buffer", sys.stdin)
    out = sys.stdout if stdout is None else stdout
    data = stdin.read()
    if isinstance(data, bytes):
        data = data.decode("utf-8", "replace")
    try:
        rollout = Rollout.from_json(json.loads(data))
    except (ValueError, RecursionError) as e:
        print(f"bragg_rl.env verify: {NOT_A_ROLLOUT}: {e}; got {data[:200]!r}", file=sys.stderr)
        return 1
    x, why, status = _score(env_factory, rollout)
    if x is None:
        print(f"bragg_rl.env verify: {why}", file=sys.stderr)
        return status
    out.write(repr(x) + "\n")
    out.flush()
    return 0


def main(env_factory: EnvFactory, argv: Optional[List[str]] = None) -> None:
    """``python3 my_env.py serve`` runs ``serve``, ``python3 my_env.py verify`` runs ``verify``;
    exits with their status (2 with a usage line for anything else). ``argv`` defaults to
    ``sys.argv``."""
    argv = sys.argv if argv is None else argv
    command = argv[1] if len(argv) == 2 else ""
    if command == "serve":
        sys.exit(serve(env_factory))
    if command == "verify":
        sys.exit(verify(env_factory))
    prog = os.path.basename(argv[0]) if argv else "env.py"
    print(f"usage: {prog} serve|verify  (serve: bragg-rl's tool server, task.tool_server; "
          f"verify: its verifier, task.verifier)", file=sys.stderr)
    sys.exit(2)


def _run_dir(config_path: str) -> str:
    import tomllib  # here, not at the top: only run() needs it

    with open(config_path, "rb") as f:
        config = tomllib.load(f)
    run_table = config.get("run", {})
    run_dir = run_table.get("dir", RUN_DIR_DEFAULT) if isinstance(run_table, dict) else None
    if not isinstance(run_dir, str) or not run_dir:
        raise ValueError(f"{config_path}: [run] dir is not a path")
    return os.path.join(os.path.dirname(os.path.abspath(config_path)), run_dir)


def run(config_path: Union[str, os.PathLike], *, resume: bool = False,
        bragg_rl: str = "bragg-rl", env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Runs ``bragg-rl run CONFIG`` (``--resume`` with ``resume``) to its end and returns the
    run's ``summary.json``, parsed. Blocks for the whole run.

    bragg-rl's output (stderr and stdout, merged) is copied line by line to this process's
    stderr as it comes. ``bragg_rl`` is the binary (looked up on PATH when it has no slash);
    ``env`` the child's whole environment (None: this process's). The summary is read from the
    config's ``[run] dir`` (relative to the config's directory; default "rl-run").

    Raises FileNotFoundError when the binary is not found, RuntimeError with the last lines of
    the output when bragg-rl exits non-zero or writes no summary. An exception here (Ctrl-C)
    terminates the run (SIGTERM, then SIGKILL after 10 s)."""
    config_path = os.fspath(config_path)
    argv = [bragg_rl, "run", config_path] + (["--resume"] if resume else [])
    tail: collections.deque = collections.deque(maxlen=TAIL_LINES)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{bragg_rl}: not found ({e.strerror}); pass bragg_rl= the path of the bragg-rl "
            f"binary (<build>/src/rl/bragg-rl) or put it on PATH") from e
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace")
            tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()
        code = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
    last = "\n".join(tail)
    if code != 0:
        how = f"signal {-code}" if code < 0 else f"status {code}"
        raise RuntimeError(f"{' '.join(argv)} exited with {how}; its last lines:\n{last}")
    summary_path = os.path.join(_run_dir(config_path), "summary.json")
    try:
        with open(summary_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"{' '.join(argv)} exited 0 but {summary_path} is not readable "
                           f"JSON ({e}); its last lines:\n{last}") from e
