"""Client, sessions, sandboxes' lifecycle, detached TTLs, argument validation (blocking API)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import pbox
from conftest import on_gvisor


def test_info_and_health(client: pbox.Client) -> None:
    info = client.info()
    assert info.version
    assert "host" in info.images
    assert info.cgroup_version in ("v1", "v2")
    assert info.max_sandboxes == 64
    assert info.default_memory_bytes > 0 and info.default_pids > 0
    h = client.health()
    assert h.serving is True
    assert h.live_sandboxes == info.live_sandboxes


def test_parse_size() -> None:
    assert pbox.parse_size(4096) == 4096
    assert pbox.parse_size("512M") == 512 << 20
    assert pbox.parse_size("1G") == 1 << 30
    assert pbox.parse_size("1.5GiB") == 3 << 29
    assert pbox.parse_size("64k") == 64 << 10
    assert pbox.parse_size(None) == 0
    for bad in ("lots", "1X", "-1G", "", "G", "1 G B", "1iB"):
        with pytest.raises(ValueError, match="cannot parse size"):
            pbox.parse_size(bad)
    for bad in (-1, True, [1]):
        with pytest.raises(ValueError):
            pbox.parse_size(bad)


def test_bad_arguments_fail_before_any_call(session: pbox.Session, client: pbox.Client) -> None:
    before = len(client.list())
    with pytest.raises(ValueError, match="memory: cannot parse size 'lots'"):
        session.create(memory="lots")
    with pytest.raises(ValueError, match="disk"):
        session.create(disk="-5M")
    with pytest.raises(ValueError, match="cpus"):
        session.create(cpus=-1)
    with pytest.raises(ValueError, match="env"):
        session.create(env={"": "x"})
    assert len(client.list()) == before
    with pytest.raises(ValueError, match="endpoint"):
        pbox.Client("http://localhost:1")
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        pbox.Client("tcp://localhost")


def test_unreachable_agent_is_unavailable(tmp_path) -> None:
    c = pbox.Client(f"unix://{tmp_path}/nothing.sock")
    with pytest.raises(pbox.Unavailable, match="cannot reach pboxd"):
        c.health()
    c.close()


def test_create_get_list_destroy(client: pbox.Client) -> None:
    sb = client.create(memory="300M", disk="100M", pids=77, env={"A": "1"}, workdir="/tmp/w",
                       labels={"job": "py"}, idle_ttl=600)
    try:
        assert sb.id
        assert sb.session_id == ""
        spec = sb.info.spec
        assert spec.memory_bytes == 300 << 20
        assert spec.disk_bytes == 100 << 20
        assert spec.pids == 77
        assert spec.env == {"A": "1"}
        assert spec.labels == {"job": "py"}
        assert spec.idle_ttl_seconds == 600
        assert sb.info.state == "running"
        got = client.get(sb.id)
        assert got.id == sb.id and got.info.spec == spec
        assert sb.id in [s.id for s in client.list()]
        r = sb.run("echo $A; pwd")
        assert r.stdout == b"1\n/tmp/w\n"
        assert sb.refresh().last_used_unix_ms >= sb.info.created_unix_ms
    finally:
        sb.destroy()
    assert sb.id not in [s.id for s in client.list()]
    with pytest.raises(pbox.NotFound):
        client.get(sb.id)
    with pytest.raises(pbox.NotFound) as e:
        sb.destroy()
    assert e.value.code.name == "NOT_FOUND"
    assert isinstance(e.value, pbox.PboxError) and e.value.message
    sb.destroy(missing_ok=True)
    with pytest.raises(pbox.NotFound):
        sb.run("true")
    with pytest.raises(pbox.NotFound):
        client.get("sb-does-not-exist")


def test_unknown_image_is_refused(session: pbox.Session) -> None:
    with pytest.raises(pbox.PboxError) as e:
        session.create(image="no-such-image")
    assert isinstance(e.value, (pbox.InvalidArgument, pbox.NotFound))
    assert "no-such-image" in str(e.value)


def test_sandbox_context_manager_destroys(session: pbox.Session, client: pbox.Client) -> None:
    with session.create() as sb:
        assert sb.run("true").ok
        sid = sb.id
    assert sid not in [s.id for s in client.list()]


def test_session_close_destroys_its_sandboxes_only(client: pbox.Client) -> None:
    keeper = client.session(client_name="keeper")
    kept = keeper.create()
    with client.session(client_name="short") as s:
        assert s.id and s.id != keeper.id
        ids = {s.create().id for _ in range(3)}
        assert {x.id for x in s.list()} == ids
        assert all(x.session_id == s.id for x in client.list(s.id))
        assert s.ping() < 5
    assert s.closed
    assert client.list(s.id) == []
    live = {x.id for x in client.list()}
    assert not (ids & live)
    assert kept.id in live
    with pytest.raises(pbox.SessionClosed):
        s.create()
    keeper.close()
    assert kept.id not in {x.id for x in client.list()}


def test_session_with_pings_stays_open(client: pbox.Client) -> None:
    with client.session(ping_interval=0.1) as s:
        sb = s.create()
        time.sleep(0.5)
        assert not s.closed
        assert sb.run("true").ok


def test_client_close_closes_sessions(agent) -> None:
    c = agent.client()
    s = c.session()
    sb = s.create()
    c.close()
    assert s.closed
    with agent.client() as c2:
        assert sb.id not in {x.id for x in c2.list()}


CHILD = textwrap.dedent("""
    import sys, time
    import pbox
    c = pbox.Client(sys.argv[1])
    s = c.session(client_name="doomed")
    for _ in range(20):
        s.create(memory="64M", disk="16M")
    print(s.id, flush=True)
    time.sleep(1000)
""")


def test_kill_9_client_destroys_its_sandboxes_within_1s(client: pbox.Client, agent) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, agent.endpoint],
                            stdout=subprocess.PIPE, env=env)
    try:
        line = proc.stdout.readline().decode().strip()
        assert line, "child did not open its session"
        session_id = line
        assert len(client.list(session_id)) == 20
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait()
        left = client.list(session_id)
        while left and time.monotonic() - killed_at < 1.0:
            time.sleep(0.05)
            left = client.list(session_id)
        elapsed = time.monotonic() - killed_at
        assert left == [], f"{len(left)} sandboxes left {elapsed:.2f} s after kill -9"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_detached_sandbox_idle_ttl(make_agent) -> None:
    agent = make_agent(extra=["--detached-ttl", "2"])
    with agent.client() as c:
        idle = c.create()
        busy = c.create()
        own = c.create(idle_ttl=30)
        assert idle.info.spec.idle_ttl_seconds == 2
        assert own.info.spec.idle_ttl_seconds == 30
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            assert busy.run("true").ok  # every call resets its idle clock
            time.sleep(0.4)
        live = {x.id for x in c.list()}
        assert idle.id not in live
        assert busy.id in live
        assert own.id in live
        with pytest.raises(pbox.NotFound):
            idle.run("true")
        time.sleep(3.5)
        live = {x.id for x in c.list()}
        assert busy.id not in live
        assert own.id in live


def test_session_sandbox_with_idle_ttl(client: pbox.Client) -> None:
    with client.session() as s:
        sb = s.create(idle_ttl=1)
        stay = s.create()
        deadline = time.monotonic() + 6
        while sb.id in {x.id for x in s.list()} and time.monotonic() < deadline:
            time.sleep(0.2)
        live = {x.id for x in s.list()}
        assert sb.id not in live
        assert stay.id in live


def test_admission_limit_is_resource_exhausted(make_agent) -> None:
    agent = make_agent(extra=["--max-sandboxes", "2"])
    with agent.client() as c, c.session() as s:
        s.create()
        s.create()
        with pytest.raises(pbox.ResourceExhausted):
            s.create()
        assert c.info().live_sandboxes == 2


def _host_cpus_of(sandbox_id: str) -> set:
    """Cpus_allowed_list of every host process whose command line names the sandbox (gVisor:
    runsc, the sentry and the gofer)."""
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if sandbox_id.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        out.add(line.split()[-1])
        except OSError:
            continue
    assert out, f"no host process of {sandbox_id}"
    return out


def test_session_cpuset_keeps_a_jobs_sandboxes_on_its_cpus(make_agent) -> None:
    """Long-lived mode: one agent shared by jobs; each job's session names its CPU set."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs 2 CPUs")
    pool = allowed[:2]
    agent = make_agent(extra=["--cpus", f"{pool[0]},{pool[1]}"])
    with agent.client() as client:
        with client.session(client_name="job-a", job_id="101", cpuset=str(pool[1])) as job_a, \
                client.session(client_name="job-b", job_id="102", cpuset=[pool[0]]) as job_b:
            mine = [job_a.create(cpus=1) for _ in range(3)]
            theirs = job_b.create(cpus=1)
            for sb in mine:
                assert sb.info.cpuset == str(pool[1]), sb.info
                if on_gvisor():
                    # gVisor's CPUs inside are its own (no Cpus_allowed_list there); the
                    # cpuset holds runsc, the sentry and the gofer on the host.
                    assert _host_cpus_of(sb.id) == {str(pool[1])}
                else:
                    r = sb.run(["grep", "Cpus_allowed_list", "/proc/self/status"])
                    assert r.ok and r.stdout.split()[-1] == str(pool[1]).encode(), r
            assert theirs.info.cpuset == str(pool[0]), theirs.info
            # More CPUs than the job's set holds.
            with pytest.raises(pbox.InvalidArgument, match="session"):
                job_a.create(cpus=2)
            # A session without a CPU set spreads over the whole pool, as before.
            with client.session(client_name="any") as anyone:
                assert pbox.parse_cpu_list(anyone.create(cpus=2).info.cpuset) == pool
        # A CPU set outside the agent's, or one that does not parse, is refused at open.
        for bad in ["4096", f"{pool[0]}-4096", "1-", "junk", "-1"]:
            with pytest.raises(pbox.InvalidArgument):
                client.session(cpuset=bad, open_timeout=10)
        with pytest.raises(ValueError):
            client.session(cpuset=[-1])
        assert client.list() == [], "sessions that ended left sandboxes"
