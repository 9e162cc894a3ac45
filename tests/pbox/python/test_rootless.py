"""pboxd without root (docs/security.md "Rootless"): what is particular to the mode.

The isolation probes, hostile workloads, reaping, clones and image imports run rootless in
ctest `pbox_python_rootless` (the same files with $PBOX_TEST_ROOTLESS=1). Here: the mode as the
agent reports it, the user namespace as a sandbox sees it, the refusals of a rootless agent
(gVisor; a cgroup not delegated; a run directory that is not its own), and the default paths
that let a user start `pboxd` and use `pbox` with no flags.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Optional

import pytest

import pbox
import rootless_user
from conftest import fuse_overlayfs_daemons, wait_for


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


@contextlib.contextmanager
def _userns_agent(pboxd_binary: str, *flags: str, env: Optional[dict] = None,
                  output: Optional[List[str]] = None) -> Iterator[pbox.Client]:
    """pboxd as root of a user namespace (`unshare -Ur`, a rootless container's root) with
    `flags` (and `env`), and a client of it; on leaving, it must stop cleanly on SIGTERM. What
    it printed is appended to `output`. Its state is under /var/tmp: an image's opaque
    directories need user.* xattrs, which tmpfs (the test VM's /tmp) has only from Linux 6.6."""
    root = Path(tempfile.mkdtemp(prefix="pbu-", dir="/var/tmp"))
    sock, ready = root / "p.sock", root / "ready"
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", pboxd_binary, "--listen",
                             f"unix://{sock}", "--state-dir", str(root / "state"),
                             "--ready-file", str(ready), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(proc, ready, "pboxd did not listen")
        with pbox.Client(f"unix://{sock}") as c:
            yield c
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = _wait_exit(proc, 30)
        shutil.rmtree(root, ignore_errors=True)
    out = proc.stdout.read().decode()
    assert rc == 0, out
    if output is not None:
        output.append(out)


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
    with _userns_agent(pboxd_binary) as c:
        info = c.info()
        assert (info.mode, info.uid, info.runtimes) == ("rootless", 0, ["native"]), info
        sb = c.create(memory="64M", disk="16M")
        r = sb.run(["sh", "-c", "cat /proc/self/uid_map; echo x > /dev/null && echo ok"],
                   timeout=30)
        assert r.ok, r
        assert r.stdout.decode().split() == ["0", "0", "1", "ok"], r.stdout
        sb.destroy()


def _refused_at_start(pboxd_binary: str, unshare: list, script: str, *flags: str,
                      env: Optional[dict] = None) -> str:
    """Runs pboxd (with `flags`, and `env`) under `unshare UNSHARE sh -c SCRIPT` (SCRIPT ends in
    `exec "$@"`); asserts it exits 1 without making its socket, and returns what it printed."""
    root = Path(tempfile.mkdtemp(prefix="pbr-", dir="/tmp"))
    sock = root / "p.sock"
    proc = subprocess.Popen(
        ["unshare", *unshare, "sh", "-c", script, "sh", pboxd_binary,
         "--listen", f"unix://{sock}", "--state-dir", str(root / "state"), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
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


# ---- sandboxes' roots as fuse-overlayfs mounts (--overlay fuse; auto before Linux 5.11) ----
# The isolation probes, hostile workloads, file API, clones and reaping run with them in ctest
# `pbox_python_rootless_fuse` (the same files with $PBOX_TEST_OVERLAY=fuse). Here: what is
# particular to them.


def test_fuse_overlayfs_roots_hold_files_whiteouts_and_the_disk_limit(make_agent) -> None:
    """A rootless agent with --overlay fuse: each sandbox's root is a fuse-overlayfs mount, run
    by the agent's user in a user namespace of its own, so that the kernel lets in both the
    sandbox's processes and the agent's file API (which a mount with allow_other, what
    fuse-overlayfs forces when it runs as root of its namespace, would refuse the agent)."""
    agent = make_agent(rootless=True, extra=["--overlay", "fuse"])
    user = agent.user
    with agent.client() as c:
        info = c.info()
        assert (info.mode, info.root_fs) == ("rootless", "fuse-overlayfs"), info
        sb = c.create(memory="256M", disk="16M")
        daemons = fuse_overlayfs_daemons(agent.state_dir)
        # One daemon, the agent's user, outside the sandbox's cgroup (a paused sandbox does not
        # freeze the file system the agent reads).
        assert len(daemons) == 1, daemons
        assert _uid_of(daemons[0]) == user.pw_uid
        assert not _in_sandbox(daemons[0], sb.id)
        r = sb.run(["sh", "-c",
                    # The root's file system type: the field after the separator "-".
                    "awk '$5 == \"/\" {for (i = 6; i < NF; i++) if ($i == \"-\") "
                    "print $(i + 1)}' /proc/self/mountinfo; cat /proc/self/uid_map; "
                    "echo inside > /inside && cat /inside; "
                    # A directory of the image removed and made again is empty (opaque).
                    "rm -r /etc && ! test -e /etc/hostname && mkdir /etc && ls -A /etc | wc -l; "
                    "stat -c %u /usr /inside; "
                    "dd if=/dev/zero of=/big bs=1M count=64 2>&1 | grep -c 'No space'"],
                   timeout=60)
        assert r.ok, r
        lines = r.stdout.decode().split("\n")
        assert lines[0] == "fuse.fuse-overlayfs", lines
        assert lines[1].split() == ["0", str(user.pw_uid), "1"], lines
        assert lines[2:6] == ["inside", "0", "65534", "0"], lines
        assert lines[6] == "1", lines  # the writable layer's size holds (ENOSPC)
        sb.remove("/big")
        # The file API reads and writes the same files from outside.
        assert sb.read_file("/inside") == b"inside\n"
        sb.write_file("/from-agent/f", b"outside")
        assert sb.run(["cat", "/from-agent/f"]).stdout == b"outside"
        assert sb.listdir("/etc") == []
        sb.move("/inside", "/moved")
        assert not sb.exists("/inside") and sb.read_file("/moved") == b"inside\n"
        # A clone stacks this layer (fuse-overlayfs's whiteouts included) under its own root.
        (clone,) = sb.clone(1)
        r = clone.run(["sh", "-c", "cat /moved /from-agent/f; echo; ls -A /etc | wc -l; "
                       "test -e /inside || echo gone"], timeout=60)
        assert r.ok and r.stdout.decode().split("\n") == ["inside", "outside", "0", "gone", ""], r
        assert len(fuse_overlayfs_daemons(agent.state_dir)) == 2
        # Each daemon goes with its sandbox.
        clone.destroy()
        sb.destroy()
        assert wait_for(lambda: fuse_overlayfs_daemons(agent.state_dir) == [], 10), \
            fuse_overlayfs_daemons(agent.state_dir)


def test_root_of_a_user_namespace_runs_fuse_overlayfs_as_another_id(pboxd_binary: str) -> None:
    """An agent that is root of its user namespace (`unshare -Ur`, as in a rootless container)
    maps itself to 1 in fuse-overlayfs's namespace: as 0 there, fuse-overlayfs would mount
    with allow_other, and the agent could not read the sandbox's files."""
    with _userns_agent(pboxd_binary, "--overlay", "fuse") as c:
        assert c.info().root_fs == "fuse-overlayfs"
        sb = c.create(memory="64M", disk="16M")
        assert sb.run(["sh", "-c", "echo x > /x"]).ok
        assert sb.read_file("/x") == b"x\n"
        sb.destroy()


def test_overlay_fuse_refusals_name_the_cause(pboxd_binary: str, make_agent) -> None:
    """--overlay fuse without fuse-overlayfs, or as root, stops the agent at start saying why."""
    root = Path(tempfile.mkdtemp(prefix="pbf-", dir="/tmp"))
    try:
        for args, want in (
                (["--overlay", "fuse", "--fuse-overlayfs", "/nonexistent/fuse-overlayfs"],
                 "fuse-overlayfs"),
                (["--overlay", "bogus"], "--overlay")):
            r = subprocess.run(["unshare", "--user", "--map-root-user", pboxd_binary, "--listen",
                                f"unix://{root}/p.sock", "--state-dir", str(root / "s"), *args],
                               capture_output=True, text=True, timeout=30)
            assert r.returncode != 0 and want in r.stdout + r.stderr, r
            assert not (root / "p.sock").exists()
        # As root of the host, the roots are the kernel's overlay: "fuse" is refused.
        r = subprocess.run([pboxd_binary, "--listen", f"unix://{root}/p.sock", "--state-dir",
                            str(root / "s2"), "--overlay", "fuse"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "for a rootless pboxd" in r.stdout + r.stderr, r
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def old_kernel_shim(pboxd_binary: str) -> Iterator[Path]:
    """tests/pbox/old_kernel_shim.c as an LD_PRELOAD library under which pboxd meets what a
    kernel before 5.8 refuses a user (an OverlayFS with `userxattr`, the overlay's 0/0 whiteout
    device): the one in pboxd's build tree, or, for a pboxd installed from a wheel
    (scripts/check-wheel), built here from the source beside these tests."""
    build = Path(pboxd_binary).resolve().parents[2]
    built = build / "tests" / "pbox" / "libpbox_old_kernel_shim.so"
    if built.exists():
        yield built
        return
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, f"no {built} and no C compiler to build tests/pbox/old_kernel_shim.c"
    out = Path(tempfile.mkdtemp(prefix="pbox-old-kernel-shim-"))
    try:
        out.chmod(0o755)  # loaded by pboxd, which may run as the test's unprivileged user
        shim = out / "libpbox_old_kernel_shim.so"
        source = Path(__file__).resolve().parents[1] / "old_kernel_shim.c"
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"],
                       check=True)
        yield shim
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_auto_falls_back_to_fuse_overlayfs_where_the_kernel_refuses_the_overlay(
        pboxd_binary: str, old_kernel_shim: Path) -> None:
    """--overlay auto (the default) on a kernel that refuses an OverlayFS in a user namespace
    (emulated, tests/pbox/old_kernel_shim.c: what Linux before 5.8 refuses a user) starts with
    fuse-overlayfs roots, saying so; without a usable fuse-overlayfs either, it stops at start
    naming both causes. An imported image's whiteouts, which such a kernel lets no user make
    as the overlay's 0/0 devices, are kept as the archive's .wh. files, which fuse-overlayfs
    honours."""
    from test_images import Layer, docker_archive

    env = dict(os.environ, LD_PRELOAD=str(old_kernel_shim))
    # Nothing to fall back on: both reasons, and no socket.
    out = _refused_at_start(pboxd_binary, ["--user", "--map-root-user"], 'exec "$@"',
                            "--fuse-overlayfs", "/nonexistent/fuse-overlayfs", env=env)
    assert "refuses it" in out and "userxattr" in out, out
    assert "fuse-overlayfs, the way round, is not usable" in out, out
    # --overlay kernel: the kernel's refusal alone, naming fuse-overlayfs as the way out.
    out = _refused_at_start(pboxd_binary, ["--user", "--map-root-user"], 'exec "$@"',
                            "--overlay", "kernel", env=env)
    assert "install fuse-overlayfs" in out, out
    # With fuse-overlayfs: it starts, warns, and its sandboxes work.
    output: List[str] = []
    with _userns_agent(pboxd_binary, env=env, output=output) as c:
        assert c.info().root_fs == "fuse-overlayfs"
        sb = c.create(memory="64M", disk="16M")
        assert sb.run(["sh", "-c", "echo y > /y"]).ok
        assert sb.read_file("/y") == b"y\n"
        sb.destroy()
        lower = (Layer().file("etc/a", b"one\n").file("etc/b", b"bee\n").dir("data")
                 .file("data/old", b"o").dir("gone").file("gone/y", b"y").bytes())
        upper = (Layer().file("etc/.wh.b", b"").dir("data").file("data/.wh..wh..opq", b"")
                 .file("data/new", b"n").file(".wh.gone", b"").bytes())
        with tempfile.TemporaryDirectory(prefix="pbk-", dir="/tmp") as tmp:
            archive = Path(tmp) / "layered.tar"
            archive.write_bytes(docker_archive([lower, upper]))
            c.import_image("layered", archive)
        sb = c.create(image="layered", memory="64M", disk="16M")
        assert sb.read_file("/etc/a") == b"one\n"
        assert not sb.exists("/etc/b") and not sb.exists("/gone")
        assert [f.path for f in sb.listdir("/data")] == ["new"]
        assert [f.path for f in sb.listdir("/etc")] == ["a"]
        sb.destroy()
    assert "sandboxes' roots are fuse-overlayfs mounts instead" in output[0], output
