"""Run and Exec (blocking API): exit codes, output, stdin, env, cwd, timeouts, truncation,
streaming, signals."""

from __future__ import annotations

import signal
import threading
import time

import pytest

import pbox
from conftest import on_gvisor


def test_run_exit_codes_and_streams(sandbox: pbox.Sandbox) -> None:
    r = sandbox.run(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert r.exit_code == 7 and r.signal == 0
    assert r.stdout == b"out\n" and r.stderr == b"err\n"
    assert r.stdout_bytes == 4 and r.stderr_bytes == 4
    assert not r.ok
    with pytest.raises(pbox.CommandError, match="exited with code 7") as e:
        r.check()
    assert e.value.result is r
    ok = sandbox.run("true")
    assert ok.ok and ok.check() is ok
    assert ok.wall_time_ms > 0


def test_run_program_not_found(sandbox: pbox.Sandbox) -> None:
    r = sandbox.run(["/no/such/program"])
    assert r.exit_code == 127
    assert not r.ok


def test_run_killed_by_signal(sandbox: pbox.Sandbox) -> None:
    r = sandbox.run("kill -TERM $$")
    assert r.signal == signal.SIGTERM
    assert "signal 15" in r.describe()


def test_run_stdin_env_cwd(sandbox: pbox.Sandbox) -> None:
    data = bytes(range(256)) * 1000
    r = sandbox.run(["sh", "-c", "cat | sha256sum"], stdin=data)
    import hashlib

    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    r = sandbox.run(["cat"], stdin="héllo")
    assert r.stdout == "héllo".encode()
    r = sandbox.run("echo $FOO-$BAR", env={"FOO": "a b", "BAR": "2"})
    assert r.stdout == b"a b-2\n"
    sandbox.mkdir("/tmp/wd")
    r = sandbox.run(["pwd"], cwd="/tmp/wd")
    assert r.stdout == b"/tmp/wd\n"
    r = sandbox.run(["pwd"], cwd="/no/such/dir")
    assert not r.ok


def test_run_python_with_numpy(sandbox: pbox.Sandbox) -> None:
    r = sandbox.run(["/usr/bin/python3", "-c", "import numpy; print(int(numpy.arange(10).sum()))"])
    r.check()
    assert r.stdout == b"45\n"


def test_coreutils_stat_and_python_stat(sandbox: pbox.Sandbox) -> None:
    """`stat`/`ls` use statx with AT_NO_AUTOMOUNT, which gVisor 20221219 rejects (EINVAL);
    Python's os.stat (fstatat) works on both runtimes (docs/pbox.md, "The gVisor runtime")."""
    py = sandbox.run(["python3", "-c", "import os; print(oct(os.stat('/etc/passwd').st_mode))"])
    assert py.ok and py.stdout == b"0o100644\n", py
    r = sandbox.run(["stat", "-c", "%a", "/etc/passwd"])
    if on_gvisor():
        assert not r.ok and b"Invalid argument" in r.stderr, r
    else:
        assert r.ok and r.stdout == b"644\n", r


def test_run_timeout(sandbox: pbox.Sandbox) -> None:
    t0 = time.monotonic()
    r = sandbox.run(["sleep", "30"], timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert r.timed_out and not r.ok
    assert "timeout" in r.describe()
    with pytest.raises(pbox.CommandError, match="timeout"):
        r.check()


def test_run_truncation_keeps_head_and_tail(sandbox: pbox.Sandbox) -> None:
    script = "echo HEAD; head -c 5000000 /dev/zero | tr '\\0' x; echo; echo TAIL"
    r = sandbox.run(["sh", "-c", script], max_output="64K")
    assert r.stdout_truncated and not r.stderr_truncated
    assert r.stdout_bytes == 5 + 5000000 + 1 + 5
    assert r.stdout.startswith(b"HEAD\nxxx")
    assert r.stdout.endswith(b"xxx\nTAIL\n")
    assert b"bytes dropped]" in r.stdout
    assert len(r.stdout) < 64 * 1024 + 100
    r = sandbox.run(["sh", "-c", "head -c 3000000 /dev/zero >&2"])  # default cap 1 MiB
    assert r.stderr_truncated and r.stderr_bytes == 3000000
    assert len(r.stderr) < (1 << 20) + 100
    with pytest.raises(pbox.InvalidArgument, match="max_output_bytes"):
        sandbox.run("true", max_output="1G")


def test_run_bad_arguments(sandbox: pbox.Sandbox) -> None:
    with pytest.raises(ValueError, match="empty"):
        sandbox.run([])
    with pytest.raises(ValueError, match="timeout"):
        sandbox.run("true", timeout=-1)
    with pytest.raises(ValueError):
        sandbox.run([b"true"])  # type: ignore[list-item]


def test_exec_stdin_echo_round_trip(sandbox: pbox.Sandbox) -> None:
    with sandbox.exec(["cat"], stdin=True) as p:
        got = b""
        for i in range(50):
            msg = f"line {i}\n".encode()
            p.write_stdin(msg)
            while len(got) < sum(len(f"line {k}\n") for k in range(i + 1)):
                stream, data = next(iter(p))
                assert stream == "stdout"
                got += data
        p.close_stdin()
        rest = p.communicate()
    assert got + rest.stdout == b"".join(f"line {i}\n".encode() for i in range(50))
    assert p.result is not None and p.result.exit_code == 0


def test_exec_large_stdin_and_stdout(sandbox: pbox.Sandbox) -> None:
    data = b"0123456789abcdef" * (1 << 20)  # 16 MiB through stdin and back
    p = sandbox.exec(["cat"], stdin=data)
    n = 0
    import hashlib

    h = hashlib.sha256()
    for chunk in p.stdout_iter():
        h.update(chunk)
        n += len(chunk)
    assert n == len(data)
    assert h.hexdigest() == hashlib.sha256(data).hexdigest()
    assert p.result.ok


def test_exec_streams_in_order_and_separately(sandbox: pbox.Sandbox) -> None:
    p = sandbox.exec("for i in 1 2 3; do echo o$i; echo e$i >&2; sleep 0.05; done; exit 4")
    items = list(p)
    out = b"".join(d for s, d in items if s == "stdout")
    err = b"".join(d for s, d in items if s == "stderr")
    assert out == b"o1\no2\no3\n" and err == b"e1\ne2\ne3\n"
    assert p.result.exit_code == 4
    assert p.done


def test_exec_signal(sandbox: pbox.Sandbox) -> None:
    with sandbox.exec(["sh", "-c", "echo ready; sleep 1000"]) as p:
        stream, data = next(iter(p))
        assert data == b"ready\n"
        p.signal(signal.SIGTERM)
        r = p.wait()
    assert r.signal == signal.SIGTERM
    assert not r.timed_out
    # A trap sees the signal and exits on its own terms.
    p = sandbox.exec(["sh", "-c", "trap 'echo got-usr1; exit 3' USR1; echo ready; "
                                  "while :; do sleep 0.05; done"])
    it = iter(p)
    assert next(it) == ("stdout", b"ready\n")
    p.signal(signal.SIGUSR1)
    r = p.communicate()
    assert b"got-usr1" in r.stdout
    assert r.exit_code == 3


def test_exec_context_exit_kills_running_command(sandbox: pbox.Sandbox) -> None:
    with sandbox.exec(["sleep", "1000"]) as p:
        pass
    assert p.result is not None and p.result.signal == signal.SIGKILL
    with pytest.raises(pbox.PboxError):
        p.write_stdin(b"late")


def test_exec_timeout_and_missing_sandbox(sandbox: pbox.Sandbox, client: pbox.Client) -> None:
    r = sandbox.exec(["sleep", "100"], timeout=0.3).wait()
    assert r.timed_out
    ghost = pbox.Sandbox(client, sandbox.info.__class__(**{**sandbox.info.__dict__,
                                                           "id": "sb-ghost"}))
    with pytest.raises(pbox.NotFound):
        ghost.exec(["true"]).wait()


def test_concurrent_execs_in_one_sandbox(sandbox: pbox.Sandbox) -> None:
    results = {}

    def work(i: int) -> None:
        results[i] = sandbox.run(["sh", "-c", f"sleep 0.2; echo {i}"])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 < 4  # concurrent, not 8 x 0.2 s in a row plus slack
    assert all(results[i].stdout == f"{i}\n".encode() for i in range(8))


def _wait_running_execs(sandbox: pbox.Sandbox, want: int, what: str, limit_s: float = 15) -> None:
    deadline = time.monotonic() + limit_s
    while sandbox.refresh().running_execs != want:
        assert time.monotonic() < deadline, f"{what}: running_execs stayed " \
            f"{sandbox.refresh().running_execs}, expected {want}"
        time.sleep(0.05)


SLEEPERS = ("import os\n"
            "n = 0\n"
            "for p in os.listdir('/proc'):\n"
            "    try:\n"
            "        n += p.isdigit() and open(f'/proc/{p}/cmdline', 'rb').read() == "
            "b'sleep\\x003600\\x00'\n"
            "    except OSError:\n"
            "        pass\n"
            "print(n)\n")


def test_cancelled_exec_kills_its_command(sandbox: pbox.Sandbox) -> None:
    # A silent command: nothing it writes would tell the agent that the client is gone.
    proc = sandbox.exec(["sleep", "3600"])
    _wait_running_execs(sandbox, 1, "exec started")
    proc.cancel()
    _wait_running_execs(sandbox, 0, "after cancel")
    assert sandbox.run(["/usr/bin/python3", "-c", SLEEPERS]).stdout == b"0\n"


def test_cancelled_run_kills_its_command(client: pbox.Client, sandbox: pbox.Sandbox) -> None:
    from pbox import _common as c

    req, _ = c.run_request(sandbox.id, ["sleep", "3600"], None, None, None, None, None)
    call = client._stub.Run.future(req, metadata=client._md)
    _wait_running_execs(sandbox, 1, "run started")
    call.cancel()
    _wait_running_execs(sandbox, 0, "after cancel")
    assert sandbox.run(["/usr/bin/python3", "-c", SLEEPERS]).stdout == b"0\n"


def test_client_sigkill_is_not_reported_as_oom(sandbox: pbox.Sandbox) -> None:
    # A sibling dies of the OOM killer while this command is killed by the client's SIGKILL:
    # only the sibling is an OOM kill.
    if on_gvisor():
        pytest.skip("under gVisor the OOM killer takes the sentry, so the whole sandbox")
    with sandbox.exec(["sleep", "3600"]) as victim:
        _wait_running_execs(sandbox, 1, "exec started")
        hog = sandbox.run(["/usr/bin/python3", "-c",
                           "b = []\nwhile True: b.append(bytearray(16 << 20))"], timeout=60)
        victim.kill()
        res = victim.wait()
    assert res.signal == signal.SIGKILL
    assert hog.oom_killed, f"the hog was not OOM-killed: {hog.describe()}"
    assert not res.oom_killed, "a client SIGKILL was reported as an OOM kill"


def test_stdin_full_pipe_held_by_a_descendant_does_not_hang_the_call(sandbox: pbox.Sandbox) -> None:
    # The command exits at once; a background child keeps its stdin open and never reads it.
    # 8 MiB of stdin is far more than a pipe holds: the call must still end, with its result.
    # (`<&0`: sh gives an asynchronous list /dev/null as stdin unless told otherwise.)
    proc = sandbox.exec(["sh", "-c", "sleep 30 <&0 & exit 3"], stdin=True)
    writer = threading.Thread(target=lambda: _swallow(proc.write_stdin, b"x" * (8 << 20)),
                              daemon=True)
    writer.start()
    done: list = []
    waiter = threading.Thread(target=lambda: done.append(proc.wait()), daemon=True)
    waiter.start()
    waiter.join(30)
    assert done, "the Exec call hung on a stdin pipe nobody reads"
    assert done[0].exit_code == 3
    assert sandbox.run("true").ok


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except pbox.PboxError:
        pass  # the command ended while its stdin was being written: expected here


def test_stdin_nobody_reads_blocks_the_writer(sandbox: pbox.Sandbox) -> None:
    # A command that never reads its stdin holds up the client's writes (as a pipe would)
    # instead of having the sandbox buffer them: under gVisor pbox-init relays stdin, and its
    # memory is the sandbox's. Meanwhile other commands run and a signal reaches this one.
    total = 64 << 20
    proc = sandbox.exec(["sleep", "60"], stdin=True)
    sent = [0]

    def feed() -> None:
        chunk = b"s" * (1 << 20)
        try:
            while sent[0] < total:
                proc.write_stdin(chunk)
                sent[0] += len(chunk)
        except pbox.PboxError:
            pass  # the command was killed below

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    # Until the writes stall: no progress for 2 s (the pipes, the agent's and gRPC's buffers
    # fill in well under that).
    deadline = time.monotonic() + 60
    last, still_since = -1, time.monotonic()
    while time.monotonic() < deadline and sent[0] < total:
        if sent[0] != last:
            last, still_since = sent[0], time.monotonic()
        elif time.monotonic() - still_since > 2:
            break
        time.sleep(0.05)
    assert sent[0] < 32 << 20, f"{sent[0]} bytes of stdin taken by a command that never reads"
    # (proc.kill() would queue behind the stdin on the Exec call's own request stream.)
    assert sandbox.run(["pkill", "-KILL", "-x", "sleep"]).ok
    res = proc.wait()
    assert res.signal == signal.SIGKILL
    writer.join(30)
    assert not writer.is_alive()


def test_output_nobody_reads_does_not_stall_other_commands(sandbox: pbox.Sandbox) -> None:
    # The client reads nothing of this command's 64 MiB for now: its output waits in the
    # command's pipe, and the sandbox's other commands still run (under gVisor their frames
    # share one stream with it).
    total = 64 << 20
    stuck = sandbox.exec(["head", "-c", str(total), "/dev/zero"])
    time.sleep(0.5)  # let it fill every buffer on the way
    done: list = []
    other = threading.Thread(target=lambda: done.append(sandbox.run(["echo", "hi"])), daemon=True)
    other.start()
    other.join(60)
    assert done, "a command whose output nobody reads stalled another command"
    assert done[0].stdout == b"hi\n" and done[0].ok
    assert sum(len(c) for c in stuck.stdout_iter()) == total
    assert stuck.result is not None and stuck.result.ok
