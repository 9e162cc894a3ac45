"""bragg_rl.env: the tool server and the verifier, in-process (StringIO) and as real processes of
examples/python-env/count_env.py fed over pipes: a whole episode, hostile requests, exceptions in
the environment, end of input, rewards that are not numbers, env.py copied alone next to the
example (the /task upload), and run() against a fake bragg-rl.

Run by ctest (rl_env_test) under Debian's /usr/bin/python3 with PYTHONPATH=<build>/python.
"""

import io
import json
import math
import os
import select
import shutil
import stat
import subprocess
import sys
import time

import pytest

from bragg_rl import env as brenv

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE_DIR = os.path.join(REPO, "examples", "python-env")
EXAMPLE = os.path.join(EXAMPLE_DIR, "count_env.py")
PYTHON = sys.executable
REPLY_TIMEOUT_S = 30  # generous: the machine may be loaded
MB = 1 << 20


class Echo(brenv.Environment):
    """Echoes each turn as an observation; "done" ends; "boom" raises; "print" prints."""

    instances = 0

    def __init__(self):
        Echo.instances += 1
        self.reset_calls = 0
        self.seen = []

    def reset(self):
        self.reset_calls += 1

    def step(self, text):
        self.seen.append(text)
        if text == "done\n":
            return brenv.Done()
        if text == "boom\n":
            raise KeyError("boom")
        if text == "print\n":
            print("stray output from the environment")
            return brenv.Observation("printed\n", tool="print")
        if text == "none\n":
            return None
        if text == "int\n":
            return brenv.Observation(3, tool="bad")
        if text == "surrogate\n":
            return brenv.Observation("a\udcffb\n", tool="echo")
        if text == "err\n":
            return brenv.Observation("failed\n", tool="echo", error=True)
        return brenv.Observation(f"[{text}]", tool="echo")

    def reward(self, rollout):
        return float(len(rollout.turns))


def serve_lines(lines, factory=Echo):
    """Runs serve on ``lines`` (str or bytes, newline added) and returns (status, replies)."""
    if lines and isinstance(lines[0], bytes):
        stdin = io.BytesIO(b"".join(line + b"\n" for line in lines))
    else:
        stdin = io.StringIO("".join(line + "\n" for line in lines))
    stdout = io.StringIO()
    status = brenv.serve(factory, stdin=stdin, stdout=stdout)
    out = stdout.getvalue()
    assert out == "" or out.endswith("\n")
    replies = [json.loads(line) for line in out.splitlines()]
    return status, replies


def req(text):
    return json.dumps({"text": text})


# ---------------------------------------------------------------------------------------------
# serve, in-process


def test_serve_episode():
    made = []

    def factory():
        made.append(Echo())
        return made[-1]

    status, replies = serve_lines([req("look\n"), req("err\n"), req("done\n")], factory)
    assert status == 0
    assert replies == [
        {"observation": "[look\n]", "tool": "echo"},
        {"observation": "failed\n", "tool": "echo", "error": True},
        {"done": True},
    ]
    assert len(made) == 1 and made[0].reset_calls == 1
    assert made[0].seen == ["look\n", "err\n", "done\n"]


def test_serve_eof_at_once_is_exit_0_with_no_output():
    # bragg-rl's start-up probe: empty input, exit 0.
    stdout = io.StringIO()
    assert brenv.serve(Echo, stdin=io.StringIO(""), stdout=stdout) == 0
    assert stdout.getvalue() == ""


def test_serve_hostile_requests(capsys):
    huge = "x" * MB
    lines = [
        "not json",
        "",
        "[1, 2]",
        "\"text\"",
        json.dumps({"txt": "a\n"}),
        json.dumps({"text": 3}),
        json.dumps({"text": None}),
        json.dumps({"text": ["a"]}),
        "{" * 100000,  # nesting deep enough to exhaust the parser's recursion
        "{\"text\": \"unterminated",
        huge,  # 1 MB that is not JSON
        req(huge),  # 1 MB that is
        req("héllo ✓ 😀\n"),
        req("after\n"),
    ]
    status, replies = serve_lines(lines)
    assert status == 0
    assert len(replies) == len(lines)
    for reply in replies[:11]:
        assert reply == {"observation": "error: bad request\n", "error": True}
    assert replies[11] == {"observation": f"[{huge}]", "tool": "echo"}
    assert replies[12] == {"observation": "[héllo ✓ 😀\n]", "tool": "echo"}
    assert replies[13] == {"observation": "[after\n]", "tool": "echo"}
    assert "bad request" in capsys.readouterr().err


def test_serve_replies_are_one_ascii_line_each():
    text = "line one\nline two\r\n\u2028end\x00\n"
    stdout = io.StringIO()
    brenv.serve(Echo, stdin=io.StringIO(req(text) + "\n" + req("surrogate\n") + "\n"),
                stdout=stdout)
    out = stdout.getvalue()
    assert out.isascii()
    lines = out.split("\n")
    assert lines[-1] == "" and len(lines) == 3
    assert json.loads(lines[0])["observation"] == f"[{text}]"
    # A lone surrogate would be a \udcxx escape, which bragg-rl's parser refuses.
    assert "\\udc" not in lines[1]
    assert json.loads(lines[1]) == {"observation": "a?b\n", "tool": "echo"}


def test_serve_bytes_that_are_not_utf8():
    status, replies = serve_lines([b'{"text": "caf\xe9\\n"}', b"\xff\xfe", req("x\n").encode()])
    assert status == 0
    assert replies[0] == {"observation": "[caf\ufffd\n]", "tool": "echo"}
    assert replies[1] == {"observation": "error: bad request\n", "error": True}
    assert replies[2] == {"observation": "[x\n]", "tool": "echo"}


def test_serve_exception_in_step_then_goes_on(capsys):
    status, replies = serve_lines([req("boom\n"), req("next\n"), req("boom\n"), req("done\n")])
    assert status == 0
    error = {"observation": "error: KeyError\n", "tool": "", "error": True}
    assert replies == [error, {"observation": "[next\n]", "tool": "echo"}, error, {"done": True}]
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'boom'" in err


def test_serve_step_returning_garbage_is_an_error(capsys):
    status, replies = serve_lines([req("none\n"), req("int\n"), req("ok\n")])
    assert status == 0
    error = {"observation": "error: TypeError\n", "tool": "", "error": True}
    assert replies == [error, error, {"observation": "[ok\n]", "tool": "echo"}]
    err = capsys.readouterr().err
    assert "step returned NoneType" in err
    assert "Observation.text is int" in err


def test_serve_print_in_step_does_not_corrupt_the_protocol(capsys):
    status, replies = serve_lines([req("print\n"), req("done\n")])
    assert replies == [{"observation": "printed\n", "tool": "print"}, {"done": True}]
    captured = capsys.readouterr()
    assert "stray output" in captured.err
    assert "stray output" not in captured.out


def test_serve_exception_in_reset_propagates():
    class Broken(Echo):
        def reset(self):
            raise OSError("no data file")

    with pytest.raises(OSError, match="no data file"):
        brenv.serve(Broken, stdin=io.StringIO(req("a\n") + "\n"), stdout=io.StringIO())


def test_serve_flushes_after_every_reply():
    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.flushed = []

        def flush(self):
            self.flushed.append(self.getvalue())

    out = Recorder()
    brenv.serve(Echo, stdin=io.StringIO(req("a\n") + "\n" + "junk\n"), stdout=out)
    assert len(out.flushed) == 2
    assert out.flushed[0].count("\n") == 1 and out.flushed[1].count("\n") == 2


def test_environment_defaults():
    e = brenv.Environment()
    assert e.reset() is None
    with pytest.raises(NotImplementedError):
        e.step("a\n")
    status, replies = serve_lines([req("a\n")], brenv.Environment)
    assert replies == [{"observation": "error: NotImplementedError\n", "tool": "", "error": True}]


# ---------------------------------------------------------------------------------------------
# verify, in-process

ROLLOUT = {"prompt": "count 7\n", "meta": {"n": 7}, "turns": ["double 7\n", "answer 8\n"],
           "observations": ["14\n"], "done": True}


def verify_with(factory, data):
    stdout = io.StringIO()
    status = brenv.verify(factory, stdin=io.StringIO(data), stdout=stdout)
    return status, stdout.getvalue()


def reward_env(value):
    class Fixed(brenv.Environment):
        def reward(self, rollout):
            return value() if callable(value) else value

    return Fixed


def test_verify_prints_the_reward():
    assert verify_with(Echo, json.dumps(ROLLOUT)) == (0, "2.0\n")
    assert verify_with(reward_env(1), json.dumps(ROLLOUT)) == (0, "1.0\n")
    assert verify_with(reward_env(True), json.dumps(ROLLOUT)) == (0, "1.0\n")
    assert verify_with(reward_env(-0.125), json.dumps(ROLLOUT)) == (0, "-0.125\n")
    assert verify_with(reward_env(1e-300), json.dumps(ROLLOUT)) == (0, "1e-300\n")


def test_verify_the_start_up_probe_rollout():
    probe = {"prompt": "count 7\n", "meta": {"n": 7}, "turns": [], "observations": [],
             "done": False}
    assert verify_with(Echo, json.dumps(probe)) == (0, "0.0\n")


def test_verify_gets_a_fresh_instance_and_the_rollout():
    got = []

    class Spy(brenv.Environment):
        def reward(self, rollout):
            got.append((self, rollout))
            return 0.5

    assert verify_with(Spy, json.dumps(ROLLOUT))[0] == 0
    assert verify_with(Spy, json.dumps(ROLLOUT))[0] == 0
    assert got[0][0] is not got[1][0]
    assert got[0][1] == brenv.Rollout(**ROLLOUT)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -math.inf, None, "1.0", [1.0],
                                   10**400, lambda: float("nan")])
def test_verify_non_finite_reward_is_exit_2(value, capsys):
    status, out = verify_with(reward_env(value), json.dumps(ROLLOUT))
    assert status == 2
    assert out == ""
    assert "not a finite number" in capsys.readouterr().err


def test_verify_exception_is_exit_1(capsys):
    def boom():
        raise ZeroDivisionError("no turns")

    status, out = verify_with(reward_env(boom), json.dumps(ROLLOUT))
    assert (status, out) == (1, "")
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: no turns" in err


def test_verify_print_in_reward_does_not_corrupt_the_number(capsys):
    class Chatty(brenv.Environment):
        def reward(self, rollout):
            print("thinking about it")
            return 0.25

    assert verify_with(Chatty, json.dumps(ROLLOUT)) == (0, "0.25\n")
    assert "thinking about it" in capsys.readouterr().err


@pytest.mark.parametrize("data,why", [
    ("", "not a rollout"),
    ("not json", "not a rollout"),
    ("[]", "not a JSON object"),
    (json.dumps({**ROLLOUT, "prompt": 3}), '"prompt"'),
    (json.dumps({k: v for k, v in ROLLOUT.items() if k != "turns"}), '"turns"'),
    (json.dumps({**ROLLOUT, "observations": [1]}), '"observations"'),
    (json.dumps({**ROLLOUT, "meta": [1]}), '"meta"'),
    (json.dumps({**ROLLOUT, "done": "yes"}), '"done"'),
    ("[" * 100000, "not a rollout"),
])
def test_verify_bad_input_is_exit_1_with_a_message(data, why, capsys):
    status, out = verify_with(Echo, data)
    assert (status, out) == (1, "")
    assert why in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# verify through serve (task.verifier_in_tool_server): {"verify": ROLLOUT} -> {"reward": X}


def test_serve_answers_verify_with_a_fresh_instance_between_turns():
    made = []

    class Spy(Echo):
        def __init__(self):
            super().__init__()
            made.append(self)

        def reward(self, rollout):
            # The serving instance's state is not the reward's: a fresh instance scores.
            assert self is not made[0]
            return float(len(rollout.turns))

    lines = [req("a\n"), json.dumps({"verify": ROLLOUT}), req("b\n"),
             json.dumps({"verify": {**ROLLOUT, "turns": []}})]
    status, replies = serve_lines(lines, Spy)
    assert status == 0
    assert replies == [{"observation": "[a\n]", "tool": "echo"}, {"reward": 2.0},
                       {"observation": "[b\n]", "tool": "echo"}, {"reward": 0.0}]
    assert len(made) == 3


@pytest.mark.parametrize("value", [float("nan"), None, "1.0", lambda: 1 / 0])
def test_serve_verify_failures_are_error_replies_and_the_server_goes_on(value, capsys):
    lines = [json.dumps({"verify": ROLLOUT}), json.dumps({"verify": [1]}),
             json.dumps({"verify": {**ROLLOUT, "turns": "x"}}), req("a\n")]
    status, replies = serve_lines(lines, reward_env(value))
    assert status == 0
    assert len(replies) == 4
    assert all(set(r) == {"error"} and isinstance(r["error"], str) for r in replies[:3])
    assert ("not a finite number" in replies[0]["error"]
            or "ZeroDivisionError" in replies[0]["error"])
    assert "not a JSON object" in replies[1]["error"]
    assert '"turns"' in replies[2]["error"]
    assert replies[3] == {"observation": "error: NotImplementedError\n", "tool": "",
                          "error": True}
    assert "bragg_rl.env verify:" in capsys.readouterr().err


def test_serve_verify_print_in_reward_does_not_corrupt_the_protocol(capsys):
    class Chatty(Echo):
        def reward(self, rollout):
            print("thinking about it")
            return 0.25

    assert serve_lines([json.dumps({"verify": ROLLOUT})], Chatty) == (0, [{"reward": 0.25}])
    assert "thinking about it" in capsys.readouterr().err


def test_rollout_defaults():
    r = brenv.Rollout.from_json({"prompt": "p", "meta": None, "turns": [], "observations": []})
    assert r == brenv.Rollout(prompt="p", meta={}, turns=[], observations=[], done=False)


def test_main_dispatch_and_usage(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(req("a\n") + "\n"))
    with pytest.raises(SystemExit) as e:
        brenv.main(Echo, ["my_env.py", "serve"])
    assert e.value.code == 0
    assert json.loads(capsys.readouterr().out) == {"observation": "[a\n]", "tool": "echo"}

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(ROLLOUT)))
    with pytest.raises(SystemExit) as e:
        brenv.main(Echo, ["my_env.py", "verify"])
    assert e.value.code == 0
    assert capsys.readouterr().out == "2.0\n"

    for argv in (["my_env.py"], ["my_env.py", "serv"], ["my_env.py", "serve", "x"]):
        with pytest.raises(SystemExit) as e:
            brenv.main(Echo, argv)
        assert e.value.code == 2
        assert "usage: my_env.py serve|verify" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The example as real processes, fed over pipes


_STARTED = []  # every Server's process, killed after its test if a failure left it running


@pytest.fixture(autouse=True)
def _kill_left_servers():
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


class Server:
    """A tool server process: one request written, one reply line read, with a deadline."""

    def __init__(self, argv, cwd, env=None):
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        _STARTED.append(self.proc)

    def ask(self, line):
        data = line if isinstance(line, bytes) else line.encode()
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()
        return self.read_reply()

    def read_reply(self):
        reply = b""
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not reply.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            assert ready, f"no reply within {REPLY_TIMEOUT_S} s (got {reply[:200]!r})"
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            assert chunk, f"the server closed its stdout: {self.close()}"
            reply += chunk
        assert reply.count(b"\n") == 1, reply[:200]  # one line per request, never more
        assert reply.isascii()
        return json.loads(reply)

    def close(self):
        """Closes stdin (EOF) and returns (exit status, stdout left, stderr)."""
        out, err = self.proc.communicate(timeout=REPLY_TIMEOUT_S)
        return self.proc.returncode, out.decode(), err.decode()


def tree_env():
    """This process's environment with PYTHONPATH naming the bragg_rl under test (absolute: the
    children run in other directories) and without PYTHONUNBUFFERED, which would hide a missing
    flush: a sandbox's python3 block-buffers a pipe."""
    e = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    e["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(brenv.__file__)))
    return e


def example_server():
    return Server([PYTHON, EXAMPLE, "serve"], cwd=EXAMPLE_DIR, env=tree_env())


def run_example(command, data, cwd=EXAMPLE_DIR, script=EXAMPLE, env=None):
    env = tree_env() if env is None else env
    p = subprocess.run([PYTHON, script, command], cwd=cwd, env=env, input=data.encode(),
                       capture_output=True, timeout=REPLY_TIMEOUT_S)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def test_example_episode_over_pipes():
    s = example_server()
    assert s.ask(req("double 7\n")) == {"observation": "14\n", "tool": "double"}
    assert s.ask(req("double -4\n")) == {"observation": "-8\n", "tool": "double"}
    assert s.ask(req("answer 8\n")) == {"done": True}
    assert s.close() == (0, "", "")


def test_example_hostile_lines_over_pipes():
    s = example_server()
    bad = {"observation": "error: bad request\n", "error": True}
    assert s.ask("garbage") == bad
    assert s.ask(json.dumps({"prompt": "x"})) == bad
    assert s.ask(json.dumps({"text": 7})) == bad
    assert s.ask(b"\xff\xfe\x00") == bad
    assert s.ask("x" * MB) == bad
    unknown = {"observation": "error: say `double K` or `answer M`\n", "tool": "",
               "error": True}
    assert s.ask(req("d" * MB + "\n")) == unknown
    assert s.ask(req("dóuble ✓ 😀\n")) == unknown
    # An exception in step (int("x")): an error observation, and the server goes on.
    assert s.ask(req("double x\n")) == {"observation": "error: ValueError\n", "tool": "",
                                        "error": True}
    assert s.ask(req("double 21\n")) == {"observation": "42\n", "tool": "double"}
    status, out, err = s.close()
    assert (status, out) == (0, "")
    assert "ValueError" in err and "Traceback" in err and "bad request" in err


def test_example_eof_is_exit_0():
    assert run_example("serve", "") == (0, "", "")


def test_example_verify():
    assert run_example("verify", json.dumps(ROLLOUT)) == (0, "1.0\n", "")
    no_double = {**ROLLOUT, "turns": ["answer 8\n"], "observations": []}
    assert run_example("verify", json.dumps(no_double))[:2] == (0, "0.0\n")
    wrong = {**ROLLOUT, "turns": ["double 7\n", "answer 15\n"]}
    assert run_example("verify", json.dumps(wrong))[:2] == (0, "0.0\n")
    from_prompt = {**ROLLOUT, "meta": {}}
    assert run_example("verify", json.dumps(from_prompt))[:2] == (0, "1.0\n")
    probe = {"prompt": "count 7\n", "meta": {"n": 7}, "turns": [], "observations": [],
             "done": False}
    assert run_example("verify", json.dumps(probe))[:2] == (0, "0.0\n")


def test_example_verify_bad_json_is_exit_1():
    status, out, err = run_example("verify", "{not json")
    assert (status, out) == (1, "")
    assert "not a rollout" in err


def test_example_usage_is_exit_2():
    status, out, err = run_example("", "")
    assert (status, out) == (2, "")
    assert "usage:" in err


# ---------------------------------------------------------------------------------------------
# env.py copied alone next to the user's files (the /task upload)


def bare_env():
    """This process's environment without PYTHONPATH (bragg_rl is not importable) or any other
    PYTHON* variable (PYTHONUNBUFFERED would hide a missing flush)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}


@pytest.fixture
def task_dir(tmp_path):
    task = tmp_path / "task"
    task.mkdir()
    shutil.copy(brenv.__file__, task / "env.py")
    shutil.copy(EXAMPLE, task / "count_env.py")
    return task


def test_copied_env_is_the_one_imported(task_dir):
    p = subprocess.run([PYTHON, "-s", "-c",
                        "import count_env, sys; print(count_env.Environment.__module__); "
                        "print('bragg_rl' in sys.modules)"],
                       cwd=task_dir, env=bare_env(), capture_output=True, text=True,
                       timeout=REPLY_TIMEOUT_S)
    assert (p.returncode, p.stdout) == (0, "env\nFalse\n"), p.stderr


def test_copied_env_serves_and_verifies(task_dir):
    script = str(task_dir / "count_env.py")
    s = Server([PYTHON, "-s", script, "serve"], cwd="/", env=bare_env())
    assert s.ask(req("double 5\n")) == {"observation": "10\n", "tool": "double"}
    assert s.ask("junk") == {"observation": "error: bad request\n", "error": True}
    assert s.ask(req("double nope\n"))["observation"] == "error: ValueError\n"
    assert s.ask(req("answer 6\n")) == {"done": True}
    assert s.close()[:2] == (0, "")
    status, out, _ = run_example("verify", json.dumps(ROLLOUT), cwd="/", script=script,
                                 env=bare_env())
    assert (status, out) == (0, "1.0\n")


def test_copied_env_alone_with_a_hostile_reward(task_dir):
    (task_dir / "nan_env.py").write_text(
        "import sys\n"
        "from env import Environment, main\n"
        "class NanEnv(Environment):\n"
        "    def reward(self, rollout):\n"
        "        if rollout.meta.get('raise'):\n"
        "            raise RuntimeError('reward exploded')\n"
        "        return float(rollout.meta.get('value', 'nan'))\n"
        "main(NanEnv)\n")
    script = str(task_dir / "nan_env.py")

    def verify_meta(meta):
        return run_example("verify", json.dumps({**ROLLOUT, "meta": meta}), cwd="/",
                           script=script, env=bare_env())

    status, out, err = verify_meta({})
    assert (status, out) == (2, "")
    assert "nan" in err and "not a finite number" in err
    assert verify_meta({"value": "inf"})[:2] == (2, "")
    status, out, err = verify_meta({"raise": True})
    assert (status, out) == (1, "")
    assert "RuntimeError: reward exploded" in err
    assert verify_meta({"value": "0.75"})[:2] == (0, "0.75\n")


# ---------------------------------------------------------------------------------------------
# run(), against a fake bragg-rl

FAKE_BRAGG_RL = """\
#!{python}
import json, os, sys
with open(os.environ["FAKE_ARGV"], "w") as f:
    json.dump(sys.argv[1:], f)
for i in range(int(os.environ.get("FAKE_LINES", "3"))):
    print(f"log line {{i}}", file=sys.stderr, flush=True)
print("a line on stdout", flush=True)
summary = os.environ.get("FAKE_SUMMARY")
if summary:
    os.makedirs(os.path.dirname(summary), exist_ok=True)
    with open(summary, "w") as f:
        json.dump({{"steps": 4, "reward_final": 0.5}}, f)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


@pytest.fixture
def fake(tmp_path):
    path = tmp_path / "bin" / "bragg-rl"
    path.parent.mkdir()
    path.write_text(FAKE_BRAGG_RL.format(python=PYTHON))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def write_config(tmp_path, run_table):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir(exist_ok=True)
    config = cfg_dir / "rl.toml"
    config.write_text(f"{run_table}\n[task]\nprompts = \"prompts.jsonl\"\n")
    return config


def fake_env(tmp_path, **extra):
    e = dict(os.environ, FAKE_ARGV=str(tmp_path / "argv.json"))
    e.update({k: str(v) for k, v in extra.items()})
    return e


def test_run_returns_the_summary(tmp_path, fake, capsys):
    config = write_config(tmp_path, '[run]\ndir = "out/run1"\nsteps = 4')
    summary = tmp_path / "cfg" / "out" / "run1" / "summary.json"
    got = brenv.run(str(config), bragg_rl=fake, env=fake_env(tmp_path, FAKE_SUMMARY=summary))
    assert got == {"steps": 4, "reward_final": 0.5}
    assert json.loads((tmp_path / "argv.json").read_text()) == ["run", str(config)]
    err = capsys.readouterr().err
    assert "log line 0\nlog line 1\nlog line 2\n" in err and "a line on stdout" in err


def test_run_resume_absolute_and_default_dirs(tmp_path, fake):
    absolute = tmp_path / "elsewhere"
    config = write_config(tmp_path, f'[run]\ndir = "{absolute}"')
    got = brenv.run(config, resume=True, bragg_rl=fake,
                    env=fake_env(tmp_path, FAKE_SUMMARY=absolute / "summary.json"))
    assert got["steps"] == 4
    assert json.loads((tmp_path / "argv.json").read_text()) == ["run", str(config), "--resume"]

    config = write_config(tmp_path, "[run]\nsteps = 1")  # no dir: the default, rl-run
    got = brenv.run(config, bragg_rl=fake, env=fake_env(
        tmp_path, FAKE_SUMMARY=tmp_path / "cfg" / "rl-run" / "summary.json"))
    assert got["reward_final"] == 0.5


def test_run_failure_raises_with_the_output_tail(tmp_path, fake, capsys):
    config = write_config(tmp_path, '[run]\ndir = "out"')
    with pytest.raises(RuntimeError) as e:
        brenv.run(config, bragg_rl=fake, env=fake_env(tmp_path, FAKE_EXIT=1, FAKE_LINES=50))
    message = str(e.value)
    assert "exited with status 1" in message
    assert "log line 49" in message and "a line on stdout" in message
    assert "log line 0\n" not in message  # the tail, not the whole output
    assert "log line 0\n" in capsys.readouterr().err  # which was streamed as it came


def test_run_exit_0_without_summary_raises(tmp_path, fake):
    config = write_config(tmp_path, '[run]\ndir = "out"')
    with pytest.raises(RuntimeError, match="summary.json is not readable"):
        brenv.run(config, bragg_rl=fake, env=fake_env(tmp_path))


def test_run_missing_binary(tmp_path):
    config = write_config(tmp_path, '[run]\ndir = "out"')
    with pytest.raises(FileNotFoundError, match="pass bragg_rl="):
        brenv.run(config, bragg_rl=str(tmp_path / "no-such-bragg-rl"))
