"""`pboxd --reap`: what a SIGKILLed agent left (sandbox processes, their cgroups, mounts, frozen
layers, the parent cgroups) goes without starting an agent on its state dir again."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from conftest import fuse_overlayfs_daemons, host_processes_with_argv, on_rootless, wait_for
from test_faults import _cgroup_dirs_named, _host_processes_naming, _mounts_under

MARKER = ["sleep", "7773"]


def _have_runsc() -> bool:
    return shutil.which("runsc") is not None


def _freeze(parents, sandbox_id: str) -> None:
    """Freezes a sandbox's cgroup behind the agent's back: its pbox-init cannot act on the
    agent's death, so its processes outlive the agent as those of a stuck sandbox would."""
    for parent in parents:
        d = parent / sandbox_id
        if (d / "freezer.state").exists():
            (d / "freezer.state").write_text("FROZEN")
            return
        if (d / "cgroup.freeze").exists():
            (d / "cgroup.freeze").write_text("1")
            return
    raise AssertionError(f"no freezer for sandbox {sandbox_id} under {parents}")


def test_reap_refused_while_the_agent_lives(make_agent) -> None:
    agent = make_agent()
    with agent.client() as c:
        sb = c.create(memory="64M", disk="16M")
        r = agent.reap()
        assert r.returncode != 0, r.stdout
        assert "another pboxd is using state dir" in r.stderr, r.stderr
        assert r.stdout == ""
        # Nothing was touched: the agent serves, the sandbox runs, the parent stays.
        assert agent.alive()
        assert sb.run(["echo", "still"]).stdout == b"still\n"
        assert agent.cgroup_parents(), "the live agent's parent cgroup went"
        assert _cgroup_dirs_named({sb.id})
        sb.destroy()
    assert agent.stop() == 0
    assert agent.cgroup_parents() == [], "a clean exit leaves its parent cgroup"


def test_reap_after_sigkill_removes_everything(make_agent) -> None:
    agent = make_agent()
    state = str(agent.state_dir)
    ids = set()
    gvisor_ids = set()
    procs = []
    with agent.client() as c:
        for _ in range(3):
            sb = c.create(memory="64M", disk="16M", runtime="native")
            ids.add(sb.id)
            procs.append(sb.exec(MARKER))
        # A clone leaves a frozen layer under <state>/frozen.
        clones = sb.clone(1)
        ids.update(cl.id for cl in clones)
        if _have_runsc() and not on_rootless():
            g = c.create(memory="128M", disk="16M", runtime="gvisor")
            assert g.run(["true"]).ok
            ids.add(g.id)
            gvisor_ids.add(g.id)
        assert wait_for(lambda: len(host_processes_with_argv(MARKER)) == 3)
        parents = agent.cgroup_parents()
        assert parents, "no parent cgroup found for the agent"
        for i in ids - gvisor_ids:
            _freeze(parents, i)
        agent.kill()
        for p in procs:
            p.cancel()
    # SIGKILL alone leaves it all behind.
    time.sleep(0.2)
    assert len(host_processes_with_argv(MARKER)) == 3
    assert agent.cgroup_parents() == parents
    assert _cgroup_dirs_named(ids)
    assert (agent.state_dir / "frozen").exists()
    for i in gvisor_ids:
        # Its bundle stays on disk; its mounts never were in the host's mount namespace (they
        # live in the bundle's own, with runsc).
        assert (agent.state_dir / "gvisor" / i).is_dir()
        assert _mounts_under(state + "/gvisor") == [], _mounts_under(state + "/gvisor")

    r = agent.reap()
    assert r.returncode == 0, r.stderr
    for i in ids:
        assert f"reaped sandbox {i}" in r.stdout, r.stdout
    for p in parents:
        assert f"removed cgroup {p}" in r.stdout, r.stdout
    assert host_processes_with_argv(MARKER) == [], "sandbox processes survived --reap"
    # --overlay fuse: each root's daemon goes with the last process of its sandbox.
    assert wait_for(lambda: fuse_overlayfs_daemons(agent.state_dir) == [], 5), \
        fuse_overlayfs_daemons(agent.state_dir)
    assert wait_for(lambda: _host_processes_naming(ids) == [], 5), "runsc processes survived"
    assert _cgroup_dirs_named(ids) == []
    assert agent.cgroup_parents() == []
    assert _mounts_under(state) == [], _mounts_under(state)
    assert not (agent.state_dir / "frozen").exists()
    assert not (agent.state_dir / "gvisor").exists()

    again = agent.reap()
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("nothing to reap"), again.stdout

    # The state dir stays usable: an agent starts there and serves.
    agent.start()
    with agent.client() as c:
        assert c.list() == []
    assert agent.stop() == 0


def test_reap_without_the_state_dir(make_agent) -> None:
    """A per-job state dir removed before the epilog ran: the parent cgroup (derived from the
    path) still goes; a path that never held an agent is fine."""
    agent = make_agent()
    agent.kill()
    assert agent.cgroup_parents()
    shutil.rmtree(agent.state_dir)
    r = agent.reap()
    assert r.returncode == 0, r.stderr
    assert "removed cgroup" in r.stdout
    assert agent.cgroup_parents() == []
    assert not agent.state_dir.exists(), "--reap created the state dir"
    again = agent.reap()
    assert again.returncode == 0 and again.stdout.startswith("nothing to reap"), again


def test_reap_finds_the_parent_however_the_state_dir_is_spelled(make_agent) -> None:
    """The parent's name comes from the state dir's absolute, normal path: an epilog that
    writes it with a trailing slash, doubled slashes or relative to another directory still
    finds what the agent made."""
    agent = make_agent()
    agent.kill()
    assert agent.cgroup_parents()
    state = agent.state_dir
    spelled = os.path.relpath(state.parent, "/tmp") + "//./" + state.name + "/"
    r = agent.run_like_agent([os.path.abspath(agent.binary), "--reap", "--state-dir", spelled],
                             timeout=60, cwd="/tmp")
    assert r.returncode == 0, r.stderr
    assert "removed cgroup" in r.stdout, r.stdout
    assert agent.cgroup_parents() == []


def test_reap_rejects_hostile_parent_names(pboxd_binary: str, tmp_path) -> None:
    for name in ("../../../sys", "a/b", "..", ""):
        r = subprocess.run([pboxd_binary, "--reap", "--state-dir", str(tmp_path / "state"),
                            "--cgroup-parent", name], capture_output=True, text=True, timeout=60)
        if name == "":
            # Empty: the default (derived from the state dir), which has nothing to reap.
            assert r.returncode == 0 and r.stdout.startswith("nothing to reap"), r
            continue
        assert r.returncode == 1, r
        assert "cgroup parent name" in r.stderr, r.stderr
        assert r.stdout == ""
    assert not (tmp_path / "state").exists()


def test_reap_purge_removes_the_state_dir_and_refuses_one_no_agent_used(make_agent,
                                                                         tmp_path) -> None:
    """`--reap --purge` (pbox-slurm's, so that an agent run as root for a user's job leaves
    nothing the user cannot remove): after the reap, the state dir goes whole, images and lock
    included; a directory that holds no agent.lock is refused and left as it was."""
    agent = make_agent()
    with agent.client() as c:
        sb = c.create(memory="64M", disk="16M")
        sb.exec(MARKER)
        assert wait_for(lambda: len(host_processes_with_argv(MARKER)) == 1)
        agent.kill()
    assert (agent.state_dir / "agent.lock").exists()
    r = agent.run_like_agent(agent.reap_args() + ["--purge"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"reaped sandbox {sb.id}" in r.stdout, r.stdout
    assert f"removed state dir {agent.state_dir}" in r.stdout, r.stdout
    assert not agent.state_dir.exists()
    assert host_processes_with_argv(MARKER) == []
    assert agent.cgroup_parents() == []

    other = tmp_path / "not-a-state-dir"
    other.mkdir()
    (other / "keep").write_text("x")
    r = subprocess.run([agent.binary, "--reap", "--purge", "--state-dir", str(other)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no agent.lock" in r.stderr, r
    assert (other / "keep").read_text() == "x" and sorted(os.listdir(other)) == ["keep"]
    r = subprocess.run([agent.binary, "--purge", "--state-dir", str(other)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--reap" in r.stderr, r
