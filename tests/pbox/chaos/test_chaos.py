"""Chaos: SIGKILL the agent at random points of create, exec, upload and destroy, restart it on
the same state dir, and check that every sandbox of the dead agent was reaped and nothing leaked;
then SIGKILL session clients mid-operation and check that their sandboxes go and the agent
stays healthy.

Kill counts: PBOX_CHAOS_AGENT_KILLS (default 100: about 400 operations in flight at the kills)
and PBOX_CHAOS_CLIENT_KILLS (default 100), as `make test` runs them; `make chaos` runs
500 + 500 (see docs/robustness.md).
PBOX_CHAOS_SEED fixes the random delays. PBOX_TEST_RUNTIME=gvisor runs every sandbox under
gVisor (`make chaos` runs a gVisor round too).

What "nothing leaked" means here, checked after every kill:
  - no process is left in the agent's cgroup parent (sandbox pbox-init and their children),
    and no sandbox cgroup directory is left under it, in any hierarchy;
  - nothing is mounted under the state dir, and <state>/mnt holds no entries;
  - no process names the state dir on its command line (runsc, its sentry and gofer keep
    their --root and --bundle there), and <state>/gvisor holds no bundle;
  - the agent lists no sandbox (agent kill) / none of the dead client's session (client kill);
  - a new sandbox runs a command.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import threading
import time
from typing import Dict, List

import pytest

import pbox
import pbox.errors
from pbox._proto import pbox_pb2 as pb

AGENT_KILLS = int(os.environ.get("PBOX_CHAOS_AGENT_KILLS", "100"))
CLIENT_KILLS = int(os.environ.get("PBOX_CHAOS_CLIENT_KILLS", "100"))
SEED = int(os.environ.get("PBOX_CHAOS_SEED", str(int(time.time()))))
CHAOS_CLIENT = os.environ.get("CHAOS_CLIENT", "")
# The agents' default runtime ($PBOX_TEST_RUNTIME, as in the Python suite): native or gvisor.
RUNTIME = os.environ.get("PBOX_TEST_RUNTIME", "") or "native"
DEADLINE_S = 30.0


def _cgroup_parent_dirs(parent_name: str) -> List[str]:
    """<own cgroup>/<parent_name> in every hierarchy this process is in (v1 and v2)."""
    out = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "":
                root = "/sys/fs/cgroup" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") \
                    else "/sys/fs/cgroup/unified"
            else:
                name = controllers.split(",")[0].replace("name=", "")
                root = next((os.path.join("/sys/fs/cgroup", d)
                             for d in os.listdir("/sys/fs/cgroup")
                             if name in d.split(",")), None)
                if root is None:
                    continue
            base = os.path.join(root, path.lstrip("/"))
            # On v2 the agent moves itself into <own>/agent; its sandboxes' parent is beside it.
            out.append(os.path.join(base, parent_name))
    return out


def _leftovers(parent_dirs: List[str]) -> Dict[str, List[str]]:
    """Sandbox cgroups and the processes still in them."""
    cgroups, procs = [], []
    for parent in parent_dirs:
        if not os.path.isdir(parent):
            continue
        for dirpath, dirnames, filenames in os.walk(parent):
            if dirpath != parent:
                cgroups.append(dirpath)
            for name in ("cgroup.procs",):
                if name in filenames:
                    try:
                        with open(os.path.join(dirpath, name)) as f:
                            procs += [p for p in f.read().split() if p]
                    except OSError:
                        pass
    return {"cgroups": sorted(set(cgroups)), "processes": sorted(set(procs))}


def _mounts_under(path: str) -> List[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f
                if line.split()[4] == path or line.split()[4].startswith(path + "/")]


def _strays(agent) -> List[str]:
    """Processes other than the agent whose command line names its state dir: runsc, its
    sentry and gofer (their --root and --bundle live there), wherever their cgroup is."""
    state = str(agent.state_dir).encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or (agent.proc is not None and int(entry) == agent.pid):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if state in cmdline:
            text = cmdline.replace(b"\0", b" ")[:160].decode(errors="replace")
            out.append(f"{entry}: {text}")
    return out


def _bundles(agent) -> List[str]:
    """gVisor bundles (<state>/gvisor/<id>) left on disk."""
    gv = agent.state_dir / "gvisor"
    return sorted(e.name for e in os.scandir(gv) if e.is_dir()) if gv.is_dir() else []


def _wait_clean(agent, parent_dirs: List[str], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        left = _leftovers(parent_dirs)
        mounts = _mounts_under(str(agent.state_dir))
        mnt = agent.state_dir / "mnt"
        mnt_entries = sorted(os.listdir(mnt)) if mnt.is_dir() else []
        strays = _strays(agent)
        bundles = _bundles(agent)
        if not left["cgroups"] and not left["processes"] and not mounts and not mnt_entries \
                and not strays and not bundles:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: leaked {left}, mounts {mounts}, state/mnt {mnt_entries}, "
                        f"processes naming the state dir {strays}, gVisor bundles {bundles}\n"
                        f"{agent.log()}")
        time.sleep(0.02)


def _wait_session_ended(c: pbox.Client, session_id: str, what: str) -> None:
    """Waits until the agent has ended `session_id`: a create in it is then FailedPrecondition.

    An empty list alone does not say so: a create of the dead client may still be under way in
    the agent (unlisted until it is made), and the agent may not have read the broken stream yet,
    so that create may still join the session and be listed a moment later (until the session
    ends and takes it). Once the session has ended, none of its sandboxes is listed any more and
    none can join it. While it is still open, each probe adds a sandbox to it, which its end must
    take too."""
    spec = pb.SandboxSpec(memory_bytes=64 << 20, disk_bytes=16 << 20)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            c._unary("CreateSandbox", pb.CreateSandboxRequest(session_id=session_id, spec=spec))
        except pbox.errors.FailedPrecondition:
            return
        except pbox.errors.ResourceExhausted:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: session {session_id} still open {DEADLINE_S} s after its "
                        f"client was SIGKILLed; it holds {c.list(session_id)}")
        time.sleep(0.01)


def _check_new_sandbox_works(c: pbox.Client) -> None:
    sb = c.create(memory="64M", disk="16M")
    try:
        r = sb.run(["echo", "alive"], timeout=30)
        assert r.stdout == b"alive\n", r
    finally:
        sb.destroy()


class Worker(threading.Thread):
    """Loops create -> exec -> upload -> destroy against the agent until a call fails, starting
    at phase `phase`; `current` says which operation is in flight."""

    PHASES = ("create", "exec", "upload", "destroy")

    def __init__(self, client: pbox.Client, sandbox, phase: int) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.sb = sandbox
        self.phase = 0 if sandbox is None else phase
        self.start_phase = phase
        self.current = ""
        self.payload = os.urandom(512 << 10)
        self.has_sandbox = threading.Event()
        if sandbox is not None:
            self.has_sandbox.set()

    def run(self) -> None:
        try:
            while True:
                op = self.PHASES[self.phase % 4]
                self.current = op
                if op == "create":
                    self.sb = self.client.create(memory="64M", disk="16M")
                    if not self.has_sandbox.is_set():
                        # Spread the workers over the phases from here on.
                        self.has_sandbox.set()
                        self.phase = self.start_phase
                        continue
                elif op == "exec":
                    self.sb.run(["sh", "-c", "echo x; sleep 0.01"], timeout=30)
                elif op == "upload":
                    self.sb.write_file("/tmp/up", self.payload)
                else:
                    self.sb.destroy()
                self.phase += 1
        except Exception:  # the agent died under the call: that is the point
            self.has_sandbox.set()
            return


def test_agent_sigkill_at_random_points(make_agent) -> None:
    rng = random.Random(SEED)
    parent = f"pbox-chaos-{os.getpid()}"
    agent = make_agent(extra=["--cgroup-parent", parent, "--max-sandboxes", "64"])
    parent_dirs = _cgroup_parent_dirs(parent)
    in_flight = collections.Counter()
    started = time.monotonic()
    for i in range(AGENT_KILLS):
        c = agent.client()
        try:
            # Every worker starts with a create; once each has a sandbox they are spread over
            # the four phases, and the kill comes 0-50 ms later.
            workers = [Worker(c, None, k) for k in range(4)]
            for w in workers:
                w.start()
            for w in workers:
                assert w.has_sandbox.wait(DEADLINE_S), "no sandbox created within the deadline"
            if i == 0:
                # The leak checks look where the sandboxes really are.
                assert _leftovers(parent_dirs)["cgroups"], f"no sandbox cgroups in {parent_dirs}"
            time.sleep(rng.uniform(0.0, 0.05))
            for w in workers:
                in_flight[w.current] += 1
            agent.kill()
            for w in workers:
                w.join(DEADLINE_S)
                assert not w.is_alive(), "a client call hung after the agent died"
        finally:
            c.close()
        agent.start()
        _wait_clean(agent, parent_dirs, f"agent kill {i} (seed {SEED})")
        with agent.client() as c2:
            assert c2.list() == [], "the restarted agent still lists sandboxes"
            _check_new_sandbox_works(c2)
    elapsed = time.monotonic() - started
    print(f"\nagent chaos ({RUNTIME}): {AGENT_KILLS} SIGKILLs in {elapsed:.1f} s, ops in flight "
          f"at the kill: {dict(in_flight)} (seed {SEED})")
    assert agent.stop() == 0
    _wait_clean(agent, parent_dirs, "after the final stop")


def test_client_sigkill_mid_operation(make_agent) -> None:
    if not CHAOS_CLIENT or not os.access(CHAOS_CLIENT, os.X_OK):
        pytest.skip("chaos_client not built: set $CHAOS_CLIENT")
    rng = random.Random(SEED + 1)
    parent = f"pbox-chaos-c{os.getpid()}"
    agent = make_agent(extra=["--cgroup-parent", parent, "--max-sandboxes", "64"])
    parent_dirs = _cgroup_parent_dirs(parent)
    started = time.monotonic()
    with agent.client() as c:
        for i in range(CLIENT_KILLS):
            proc = subprocess.Popen([CHAOS_CLIENT, agent.endpoint], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
            session_id = proc.stdout.readline().decode().strip()
            assert session_id.startswith("ss-"), proc.stderr.read().decode()
            time.sleep(rng.uniform(0.0, 0.05))
            if proc.poll() is not None:
                pytest.fail(f"chaos_client exited early: {proc.stderr.read().decode()}")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
            # The session's stream breaks; the agent must end the lease and destroy its sandboxes,
            # those created concurrently with the kill too.
            _wait_session_ended(c, session_id, f"client kill {i} (seed {SEED})")
            left = c.list()
            assert left == [], f"client kill {i}: the dead session's sandboxes remain: {left}"
            _wait_clean(agent, parent_dirs, f"client kill {i} (seed {SEED})")
            assert agent.alive(), agent.log()
            assert c.health().serving
            if i % 10 == 0:
                _check_new_sandbox_works(c)
        _check_new_sandbox_works(c)
    elapsed = time.monotonic() - started
    print(f"\nclient chaos ({RUNTIME}): {CLIENT_KILLS} client SIGKILLs in {elapsed:.1f} s "
          f"(seed {SEED})")
    assert agent.stop() == 0
    _wait_clean(agent, parent_dirs, "after the final stop")
