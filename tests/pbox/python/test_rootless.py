"""pboxd without root (docs/security.md "Rootless"): what is particular to the mode.

The isolation probes, hostile workloads, reaping, clones and image imports run rootless in
ctest `pbox_python_rootless` (the same files with $PBOX_TEST_ROOTLESS=1). Here: the mode as the
agent reports it, the user namespace as a sandbox sees it, the refusals of a rootless agent
(gVisor; a cgroup not delegated; a run directory that is not its own), and the default paths
that let a user start `pboxd` and use `pbox` with no flags.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import pbox
import rootless_user


def _wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"pboxd still running after {timeout} s")


def _wait_ready(proc: subprocess.Popen, ready: Path, late: str, timeout: float = 30) -> None:
    """Until pboxd writes its --ready-file (not its socket, which exists from bind(), before
    listen()); fails with its output if it exits first, with `late` past the timeout."""
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, late
        time.sleep(0.05)


def test_rootless_agent_reports_its_mode_and_sandboxes_get_a_user_namespace(make_agent) -> None:
    agent = make_agent(rootless=True)
    user = agent.user
    with agent.client() as c:
        info = c.info()
        assert info.mode == "rootless" and info.uid == user.pw_uid, info
        assert {"memory", "pids"} <= set(info.limits), info.limits
        assert info.runtimes == ["native"], info.runtimes
        with pytest.raises(pbox.errors.FailedPrecondition, match="rootless"):
            c.create(runtime="gvisor")
        sb = c.create(memory="128M", disk="32M")
        try:
            r = sb.run(["sh", "-c", "cat /proc/self/uid_map /proc/self/gid_map; id -u; "
                        "stat -c %u /usr /etc/passwd; "
                        "python3 -c 'import os; os.setuid(1000)' 2>&1 | tail -1"], timeout=30)
            assert r.ok, r
            lines = r.stdout.decode().split("\n")
            # The agent's user and group are root inside, and nothing else is mapped.
            assert lines[0].split() == ["0", str(user.pw_uid), "1"], lines
            assert lines[1].split() == ["0", str(user.pw_gid), "1"], lines
            assert lines[2] == "0"
            # The host's /usr (real root's files) reads as nobody; the image's own files are
            # the agent's, so root's inside.
            assert lines[3] == "65534" and lines[4] == "0", lines
            # No other id to change to (EINVAL: unmapped), and no capability to try.
            assert "OSError" in lines[5] or "PermissionError" in lines[5], lines
            # Its processes are the agent's user on the host, never real root.
            host = [int(p) for p in os.listdir("/proc") if p.isdigit()
                    and _uid_of(int(p)) is not None and _in_sandbox(int(p), sb.id)]
            assert host and all(_uid_of(p) == user.pw_uid for p in host), host
        finally:
            sb.destroy()


def _uid_of(pid: int):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[2])  # effective
    except OSError:
        return None
    return None


def _in_sandbox(pid: int, sandbox_id: str) -> bool:
    try:
        return sandbox_id in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def test_a_cgroup_not_delegated_is_refused_naming_what_to_do(pboxd_binary: str) -> None:
    """Started in the test's own cgroup, which belongs to root: pboxd stops at once and says
    how to get a delegated one."""
    user = rootless_user.ensure_user()
    root = rootless_user.owned_tempdir(user)
    try:
        proc = subprocess.Popen(
            rootless_user.as_user(user, [pboxd_binary, "--listen", f"unix://{root}/s.sock",
                                         "--state-dir", str(root / "state")]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        rc = _wait_exit(proc, 30)
        out = proc.stdout.read().decode()
        assert rc == 1, out
        assert "not delegated" in out and "Delegate=yes" in out and "Slurm" in out, out
        assert not (root / "s.sock").exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_run_directory_of_another_user_is_refused(pboxd_binary: str) -> None:
    """$XDG_RUNTIME_DIR/pbox made first by another user (here nobody, mode 0777, who could
    rename the state dir and socket made in it): a rootless agent does not use it."""
    user = rootless_user.ensure_user()
    xdg = rootless_user.owned_tempdir(user)
    try:
        (xdg / "pbox").mkdir()
        os.chmod(xdg / "pbox", 0o777)
        os.chown(xdg / "pbox", 65534, 65534)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "XDG_RUNTIME_DIR": str(xdg)}
        proc = subprocess.Popen(rootless_user.as_user(user, [pboxd_binary]), env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        rc = _wait_exit(proc, 30)
        out = proc.stdout.read().decode()
        assert rc == 1, out
        assert f"{xdg}/pbox (uid 65534, mode 777) is on the path" in out, out
        assert not (xdg / "pbox" / "pbox.sock").exists()
    finally:
        shutil.rmtree(xdg, ignore_errors=True)


def test_default_paths_let_a_user_run_pboxd_and_pbox_without_flags(pboxd_binary: str) -> None:
    """As a user with a delegated cgroup: `pboxd` with no flags listens under
    $XDG_RUNTIME_DIR/pbox, and a client of that user given no endpoint finds it."""
    user = rootless_user.ensure_user()
    xdg = rootless_user.owned_tempdir(user)
    os.chmod(xdg, 0o700)
    delegation = rootless_user.DelegatedCgroup(user)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "XDG_RUNTIME_DIR": str(xdg),
           "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    # No --listen and no --state-dir: the defaults are what is tested.
    ready = xdg / "ready"
    proc = subprocess.Popen(rootless_user.as_user(user, [pboxd_binary, "--ready-file",
                                                         str(ready)]), env=env,
                            preexec_fn=delegation.enter, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        sock = xdg / "pbox" / "pbox.sock"
        _wait_ready(proc, ready, "pboxd did not become ready")
        assert sock.exists(), "no socket under $XDG_RUNTIME_DIR/pbox"
        assert (xdg / "pbox" / "state").is_dir()
        assert (xdg / "pbox").stat().st_mode & 0o077 == 0, "the run dir is not private"
        code = ("import pbox; c = pbox.Client(); i = c.info(); "
                "print(i.mode, c.create(disk='16M').run(['id', '-u']).stdout.decode().strip())")
        r = subprocess.run(rootless_user.as_user(user, [sys.executable, "-c", code]), env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["rootless", "0"], r.stdout
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = _wait_exit(proc, 30)
        log = proc.stdout.read().decode()
        left = delegation.remove()
        shutil.rmtree(xdg, ignore_errors=True)
    assert rc == 0, log
    assert not left, f"cgroups left behind: {left}"


@pytest.mark.parametrize("rootless", [False, True], ids=["root", "rootless"])
def test_cpu_quota_holds_in_both_modes(make_agent, rootless: bool) -> None:
    """A quarter of a CPU: a command spinning for 2 s gets about 0.5 s of CPU time, as root and
    rootless (the cpu controller of the agent's cgroup, delegated in rootless mode)."""
    agent = make_agent(rootless=rootless)
    spin = ("import time\n"
            "t0, c0 = time.monotonic(), time.process_time()\n"
            "while time.monotonic() - t0 < 2.0:\n"
            "    pass\n"
            "print(time.process_time() - c0, time.monotonic() - t0)\n")
    with agent.client() as c:
        assert "cpu" in c.info().limits
        sb = c.create(memory="128M", disk="16M", cpu_quota=0.25)
        try:
            r = sb.run(["python3", "-c", spin], timeout=60)
            assert r.ok, r
            cpu, wall = map(float, r.stdout.split())
            # CFS gives 25 ms per 100 ms period; a machine busy elsewhere only lowers it.
            assert cpu / wall < 0.4, (cpu, wall)
            assert cpu > 0.05, (cpu, wall)
        finally:
            sb.destroy()


def test_root_of_a_user_namespace_runs_rootless(pboxd_binary: str) -> None:
    """pboxd as uid 0 of a user namespace (a rootless container's root: `unshare -Ur`) can no
    more make device nodes or trusted.* xattrs than a user: it runs rootless too, its sandboxes
    in user namespaces nested in its own."""
    root = Path(tempfile.mkdtemp(prefix="pbu-", dir="/tmp"))
    sock, ready = root / "p.sock", root / "ready"
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", pboxd_binary, "--listen",
                             f"unix://{sock}", "--state-dir", str(root / "state"),
                             "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, ready, "pboxd did not listen")
        with pbox.Client(f"unix://{sock}") as c:
            info = c.info()
            assert (info.mode, info.uid, info.runtimes) == ("rootless", 0, ["native"]), info
            sb = c.create(memory="64M", disk="16M")
            r = sb.run(["sh", "-c", "cat /proc/self/uid_map; echo x > /dev/null && echo ok"],
                       timeout=30)
            assert r.ok, r
            assert r.stdout.decode().split() == ["0", "0", "1", "ok"], r.stdout
            sb.destroy()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = _wait_exit(proc, 30)
        shutil.rmtree(root, ignore_errors=True)
    assert rc == 0, proc.stdout.read().decode()


def _refused_at_start(pboxd_binary: str, unshare: list, script: str) -> str:
    """Runs pboxd under `unshare UNSHARE sh -c SCRIPT` (SCRIPT ends in `exec "$@"`); asserts
    it exits 1 without making its socket, and returns what it printed."""
    root = Path(tempfile.mkdtemp(prefix="pbr-", dir="/tmp"))
    sock = root / "p.sock"
    proc = subprocess.Popen(
        ["unshare", *unshare, "sh", "-c", script, "sh", pboxd_binary,
         "--listen", f"unix://{sock}", "--state-dir", str(root / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        rc = _wait_exit(proc, 30)
        out = proc.stdout.read().decode()
        assert rc == 1, out
        assert not sock.exists(), out
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_masked_proc_stops_a_rootless_agent_at_start(pboxd_binary: str) -> None:
    """Inside a container, /proc has paths masked by mounts over them (Docker's, podman's and
    Kubernetes' default, procMount: Default), and the kernel then refuses a user namespace a new
    /proc, which every rootless sandbox mounts. Emulated here as a container runtime does it: a
    mount namespace with /dev/null bound over /proc/keys. The agent finds this in its start-up
    probe and stops naming the way out, instead of failing every create at "mounting /proc"."""
    masked = next(p for p in ("/proc/keys", "/proc/timer_list", "/proc/kcore")
                  if os.path.exists(p))
    out = _refused_at_start(pboxd_binary, ["--user", "--map-root-user", "--mount"],
                            f'mount --bind /dev/null {masked} && exec "$@"')
    assert "mounting /proc: Operation not permitted" in out, out
    assert "procMount: Unmasked" in out and "unmask=ALL" in out, out
    # The same agent with /proc as the host has it starts (the probe is not what refuses).
    root = Path(tempfile.mkdtemp(prefix="pbm-", dir="/tmp"))
    sock = root / "p.sock"
    proc = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", pboxd_binary,
         "--listen", f"unix://{sock}", "--state-dir", str(root / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while not sock.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert sock.exists(), proc.stdout.read().decode() if proc.poll() is not None else ""
        proc.terminate()
        assert _wait_exit(proc, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_a_host_refusing_user_namespaces_stops_a_rootless_agent_at_start(
        pboxd_binary: str) -> None:
    """A rootless agent tries a sandbox's setup (a user namespace, its mounts, the overlay)
    once when it starts: where the host refuses user namespaces (here: root of a user namespace
    whose own limit on nested ones is 0, as `user.max_user_namespaces = 0` makes a host), it
    stops at once saying so, before it listens, instead of failing every create."""
    out = _refused_at_start(pboxd_binary, ["--user", "--map-root-user"],
                            'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"')
    assert "user namespace" in out and "user.max_user_namespaces" in out, out
    assert "run pboxd as root" in out, out
