"""Agent faults: SIGKILL of pboxd with live sandboxes, then a restart on the same state dir
reaps every process, mount and cgroup the dead agent left."""

from __future__ import annotations

import os
import time

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
