"""Isolation probes run inside sandboxes: every attempt to reach the host, the agent or another
sandbox must fail. The probes live in isolation_probe.py (run with the sandbox's python3); this
file prepares the host side (canary files, listeners the sandbox must not reach, a second
sandbox with a marker), merges in what only the host can see, prints the table of probes and
asserts each one.

The runtime comes from $PBOX_TEST_RUNTIME (runtime_under_test.py). A probe found open on a
runtime is listed in KNOWN_HOLES with the reason; it then xfails instead of passing silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import socket
import sys
import time
from pathlib import Path
from typing import Dict, Iterator

import pytest

import pbox
from conftest import REPO, AgentFactory
from runtime_under_test import AGENT_ARGS, RUNTIME

PROBE_SCRIPT = Path(__file__).with_name("isolation_probe.py")

# Every probe isolation_probe.py runs, with the claim it tests (docs/security.md cites these).
PROBES = {
    "read_host_files": "host files outside the image (/root, /etc, /tmp, state dir, /work) "
                       "are invisible, also through /proc/1/root and /proc/self/root",
    "init_fds_via_proc": "pbox-init's fds (the agent's log), environ and memory cannot be "
                         "opened through /proc/1",
    "write_proc_sys": "/proc/sys and /proc/sysrq-trigger cannot be opened for writing",
    "write_sys": "/sys (uevent_helper, cgroup files, power) cannot be opened for writing",
    "mount": "mount, bind mounts, fsopen and open_tree fail",
    "unshare_then_mount": "unshare(CLONE_NEWNS) fails (and a mount after it would too)",
    "unshare_newuser": "no new user, mount, net or pid namespace: unshare and clone fail",
    "setns": "setns into any namespace fails",
    "load_module": "init_module, finit_module and kexec_load fail",
    "ptrace": "ptrace of pbox-init, of the agent's pid and of every pid not in the sandbox "
              "fails; process_vm_readv of PID 1 fails",
    "signal_outside": "host pids cannot be signalled; PID 1 survives SIGKILL from inside",
    "raw_sockets": "raw and packet sockets cannot be opened",
    "net_interfaces": "network=none: loopback is the only interface",
    "tcp_host_loopback": "a listener on the host's 127.0.0.1 is unreachable",
    "udp_host_loopback": "a datagram to the host's 127.0.0.1 never arrives",
    "tcp_non_loopback": "the host's own addresses and outside addresses are unreachable "
                        "(TCP and UDP)",
    "agent_tcp_port": "the agent's TCP port is unreachable",
    "agent_unix_socket": "the agent's unix socket is unreachable",
    "host_abstract_unix": "the host's abstract unix sockets are unreachable",
    "cpuset_escape": "sched_setaffinity cannot leave the sandbox's cpuset",
    "cgroup_limits": "no cgroup file system is visible or writable (limits cannot be raised)",
    "other_sandboxes": "another sandbox's processes and files are invisible",
    "host_processes": "only the sandbox's own processes are visible",
    "keyctl": "keyctl and add_key fail",
    "perf_event_open": "perf_event_open fails",
    "userfaultfd": "userfaultfd fails",
    "bpf_io_uring": "bpf and io_uring_setup fail",
    "mknod_devices": "device nodes cannot be made; /proc/kcore and /proc/kmsg are unreadable",
    "chroot_escape": "chroot, pivot_root and open_by_handle_at fail",
    "capabilities": "every capability set is empty",
}

# runtime -> {probe: reason}: holes known and not fixed yet (xfail, reported). What they mean
# for the threat model is in docs/pbox.md ("The gVisor runtime").
KNOWN_HOLES: Dict[str, Dict[str, str]] = {
    "gvisor": {
        "init_fds_via_proc": "gVisor does not honour PR_SET_DUMPABLE for /proc/1/fd: a command "
                             "can open pbox-init's channel pipes (its own sandbox's frames; "
                             "the agent parses them as untrusted input); pbox-init's stderr "
                             "is /dev/null, not runsc's log, once it serves",
        "cpuset_escape": "gVisor's CPUs are its own (numbered from 0, as many as the "
                         "sandbox's cpuset): sched_setaffinity inside moves sentry tasks "
                         "between them, and the host ids the probe compares with do not "
                         "apply; the sentry's host threads stay in the cpuset cgroup",
    },
}

TOKEN = "isolation-token-0123456789abcdef"


def _host_addresses() -> list:
    addrs = set()
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(("10.255.255.255", 1))  # no packet: only picks the outgoing address
        addrs.add(s.getsockname()[0])
        s.close()
    except OSError:
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            addrs.add(info[4][0])
    except OSError:
        pass
    return sorted(a for a in addrs if not a.startswith("127."))


def _cpus(text: str) -> list:
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += range(int(a), int(b) + 1)
        elif part:
            out.append(int(part))
    return out


@pytest.fixture(scope="module")
def probe_results(pboxd_binary: str) -> Iterator[dict]:
    factory = AgentFactory(pboxd_binary)
    canaries: Dict[str, str] = {}
    listeners = []
    try:
        agent = factory(extra=["--max-sandboxes", "8"] + AGENT_ARGS, tcp_token=TOKEN)
        tag = secrets.token_hex(6)
        for path in (f"/root/pbox-canary-{tag}", f"/etc/pbox-canary-{tag}",
                     f"/tmp/pbox-canary-{tag}", f"/var/tmp/pbox-canary-{tag}",
                     str(agent.state_dir / f"canary-{tag}"), str(agent.root / f"canary-{tag}")):
            secret = f"HOST-SECRET-{secrets.token_hex(8)}"
            Path(path).write_text(secret)
            canaries[path] = secret
        host_dirs = ["/root", "/work", str(REPO), str(agent.state_dir)]
        markers = {d: [n for n in os.listdir(d) if n not in ("tmp", "usr", "etc", "lib")]
                   for d in host_dirs if os.path.isdir(d)}
        try:
            shadow = hashlib.sha256(Path("/etc/shadow").read_bytes()).hexdigest()
        except OSError:
            shadow = ""

        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("0.0.0.0", 0))
        tcp.listen(16)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("0.0.0.0", 0))
        abstract_name = f"pbox-probe-{tag}"
        abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        abstract.bind("\0" + abstract_name)
        abstract.listen(4)
        listeners = [tcp, udp, abstract]
        for s in listeners:
            s.setblocking(False)

        client = agent.client()
        with client.session(client_name="isolation") as session:
            other = session.create(runtime=RUNTIME, memory="128M")
            other_marker = f"pbox-other-{tag}"
            other.write_file(f"/tmp/{other_marker}", b"other sandbox")
            holder = other.exec(["/usr/bin/python3", "-c", "import time; time.sleep(600)",
                                 other_marker], timeout=300)
            sb = session.create(runtime=RUNTIME, memory="256M")
            deadline = time.monotonic() + 30
            while other_marker.encode() not in other.run(["ps", "-eo", "args"]).stdout:
                assert time.monotonic() < deadline, "the marker process never started"
                time.sleep(0.1)
            cfg = {
                "canaries": canaries,
                "host_dirs": host_dirs,
                "host_dir_markers": markers,
                "host_shadow_sha256": shadow,
                "agent_host_pid": agent.pid,
                "host_self_pid": os.getpid(),
                "host_tcp_port": tcp.getsockname()[1],
                "host_udp_port": udp.getsockname()[1],
                "host_addresses": _host_addresses(),
                "nonce": f"pbox-nonce-{tag}",
                "agent_tcp_port": int(agent.tcp_endpoint.rsplit(":", 1)[1]),
                "agent_socket": str(agent.socket),
                "abstract_name": abstract_name,
                "allowed_cpus": _cpus(sb.info.cpuset),
                "host_cpus": os.cpu_count(),
                "other_marker": other_marker,
                "try_kill_init": RUNTIME != "gvisor",
            }
            sb.write_file("/tmp/isolation_probe.py", PROBE_SCRIPT.read_bytes())
            r = sb.run(["/usr/bin/python3", "/tmp/isolation_probe.py", json.dumps(cfg)],
                       timeout=180)
            assert r.exit_code == 0, r
            results = json.loads(r.stdout)

            # What only the host sees: nothing may have arrived on its listeners.
            time.sleep(0.2)
            got_tcp = select.select([tcp], [], [], 0)[0]
            results["tcp_host_loopback"]["blocked"] &= not got_tcp
            results["tcp_non_loopback"]["blocked"] &= not got_tcp
            if got_tcp:
                results["tcp_host_loopback"]["detail"] += " | HOST LISTENER GOT A CONNECTION"
            try:
                data = udp.recv(4096)
                results["udp_host_loopback"]["blocked"] = False
                results["udp_host_loopback"]["detail"] += f" | HOST GOT {data[:40]!r}"
            except BlockingIOError:
                results["udp_host_loopback"]["detail"] += " | nothing arrived on the host"
            if select.select([abstract], [], [], 0)[0]:
                results["host_abstract_unix"]["blocked"] = False
                results["host_abstract_unix"]["detail"] += " | HOST ACCEPTED"

            # The bystander sandbox and the agent are untouched.
            assert other.read_file(f"/tmp/{other_marker}") == b"other sandbox"
            assert agent.alive(), agent.log()
            assert client.health().serving
            holder.kill()
        client.close()
        yield results
    finally:
        for s in listeners:
            s.close()
        for path in canaries:
            Path(path).unlink(missing_ok=True)
        factory.cleanup()


def test_every_probe_ran(probe_results: dict) -> None:
    assert set(probe_results) == set(PROBES)


def test_isolation_table(probe_results: dict, capsys) -> None:
    """Prints the table of probes (shown in ctest's output too)."""
    lines = [f"isolation probes on runtime {RUNTIME!r}:",
             f"{'probe':<20} {'result':<8} detail"]
    for name in PROBES:
        res = probe_results.get(name, {"blocked": False, "detail": "did not run"})
        verdict = "blocked" if res["blocked"] else "OPEN"
        lines.append(f"{name:<20} {verdict:<8} {res['detail'][:150]}")
    with capsys.disabled():
        print("\n" + "\n".join(lines), file=sys.stderr)
    report = os.environ.get("PBOX_ISOLATION_REPORT")
    if report:
        tmp = report + ".tmp"
        Path(tmp).write_text("\n".join(lines) + "\n")
        os.rename(tmp, report)


@pytest.mark.parametrize("name", list(PROBES))
def test_probe_is_blocked(probe_results: dict, name: str) -> None:
    res = probe_results[name]
    hole = KNOWN_HOLES.get(RUNTIME, {}).get(name)
    if hole and not res["blocked"]:
        pytest.xfail(f"known hole on {RUNTIME}: {hole}")
    assert res["blocked"], f"{name} ({PROBES[name]}) is OPEN: {res['detail']}"


def test_init_survives_sigkill_or_sandbox_ends_cleanly(make_agent) -> None:
    """SIGKILL of PID 1 from inside: ignored on the native runtime (PID 1 of a pid namespace);
    on gVisor it ends the sandbox (gVisor lets a same-uid task kill its container's init),
    which the agent reports without harm to anything else."""
    agent = make_agent(extra=AGENT_ARGS)
    with agent.client() as client:
        sb = client.create(runtime=RUNTIME, memory="128M")
        bystander = client.create(runtime=RUNTIME, memory="128M")
        r = sb.run(["/usr/bin/python3", "-c", "import os, time; os.kill(1, 9); time.sleep(2)"],
                   timeout=60)
        if RUNTIME == "gvisor":
            assert r.signal == 9 and not r.oom_killed, r
            with pytest.raises(pbox.PboxError) as e:
                sb.run(["true"])
            assert "not running" in str(e.value), e.value
        else:
            assert r.exit_code == 0, r
            assert sb.run(["true"]).exit_code == 0
        assert bystander.run(["true"]).exit_code == 0
        sb.destroy()
        bystander.destroy()
        assert client.info().live_sandboxes == 0
    assert agent.alive(), agent.log()
