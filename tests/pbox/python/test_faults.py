"""Agent faults: SIGKILL of pboxd with live sandboxes, then a restart on the same state dir
reaps every process, mount and cgroup the dead agent left."""

from __future__ import annotations

import fcntl
import os
import threading
import time

import pytest

from conftest import host_processes_with_argv, on_gvisor

MARKER = ["sleep", "7772"]


def _mounts_under(path: str) -> list:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mount_point = line.split()[4]
            if mount_point == path or mount_point.startswith(path + "/"):
                out.append(mount_point)
    return out


def _cgroup_dirs_named(ids: set, roots=("/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids",
                                        "/sys/fs/cgroup/cpuset", "/sys/fs/cgroup/unified",
                                        "/sys/fs/cgroup")) -> list:
    found = []
    for root in roots:
        if not os.path.isdir(root):
            continue
        for dirpath, dirnames, _ in os.walk(root):
            if dirpath.count("/") - root.count("/") > 4:
                dirnames[:] = []
                continue
            for d in dirnames:
                if any(i in d for i in ids):
                    found.append(os.path.join(dirpath, d))
    return found


def _host_processes_naming(ids: set) -> list:
    """Host pids whose command line names one of the sandbox ids (gVisor: runsc, the sentry
    and the gofer of each sandbox; the sandbox's own processes are not host processes)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace")
        except OSError:
            continue
        if any(i in argv for i in ids):
            out.append(int(entry))
    return out


def _sandbox_host_processes(ids: set) -> list:
    return _host_processes_naming(ids) if on_gvisor() else host_processes_with_argv(MARKER)


def test_sigkill_agent_then_restart_reaps_everything(make_agent) -> None:
    agent = make_agent()
    ids = set()
    procs = []
    with agent.client() as c:
        for _ in range(5):
            sb = c.create(memory="64M", disk="16M")
            ids.add(sb.id)
            procs.append(sb.exec(MARKER))
        deadline = time.monotonic() + 10
        if on_gvisor():
            # gVisor's sandboxed processes are not the host's; runsc's are, one set per sandbox.
            assert len(_sandbox_host_processes(ids)) >= 5, "no runsc processes per sandbox"
        else:
            while len(host_processes_with_argv(MARKER)) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(host_processes_with_argv(MARKER)) == 5
        assert _cgroup_dirs_named(ids), "sandbox cgroups not found where expected"
        agent.kill()
        for p in procs:
            p.cancel()
    state = str(agent.state_dir)
    agent.start()
    deadline = time.monotonic() + 5
    while _sandbox_host_processes(ids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_host_processes(ids) == [], "processes of the old sandboxes survived"
    assert _mounts_under(state) == [], _mounts_under(state)
    assert _cgroup_dirs_named(ids) == []
    with agent.client() as c:
        assert c.list() == []
        with c.session() as s:
            sb = s.create()
            assert sb.run(["echo", "alive"]).stdout == b"alive\n"
    assert agent.stop() == 0
    assert _mounts_under(state) == []


def test_state_dir_lock_waits_for_a_dead_agents_child(make_agent) -> None:
    """A process the SIGKILLed agent forked just before its death holds a copy of the state
    dir lock until it closes its inherited fds: the next agent waits for that (up to 3 s)
    instead of calling the state dir taken. A live agent on the same state dir is still
    refused."""
    agent = make_agent()
    agent.kill()
    # This process plays the dead agent's child: it holds the lock for 1 s.
    fd = os.open(agent.state_dir / "agent.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    released = threading.Event()

    def release() -> None:
        released.set()
        os.close(fd)

    timer = threading.Timer(1.0, release)
    timer.start()
    try:
        agent.start()
        assert released.is_set(), "the agent started while the lock was still held"
        with agent.client() as c:
            assert c.health().serving
    finally:
        timer.join()
    second = make_agent(root=agent.root, start=False)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        second.start()
    assert "another pboxd is using state dir" in str(e.value)
    assert time.monotonic() - t0 < 20
    assert agent.alive()
