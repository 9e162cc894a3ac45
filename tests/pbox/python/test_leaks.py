"""Leak test: create/exec/destroy cycles, several at once, leave nothing behind: no process, no
mount (the host's and the agent's mount tables), no cgroup, no network namespace, no state
directory, no agent file descriptor; the agent's RSS after equals its RSS before (after a
warm-up) within 10%.

    PBOX_LEAK_CYCLES       cycles (default 250: under a minute on a loaded 2-core machine;
                           `make soak` runs 10,000)
    PBOX_LEAK_CONCURRENCY  cycles in flight at once (default 6)
    PBOX_LEAK_WARMUP       cycles before the baseline (default max(200, cycles / 10))
    PBOX_LEAK_REPORT       write the measurements as JSON to this path (by rename)
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Set

import pbox
from runtime_under_test import AGENT_ARGS, RUNTIME

CYCLES = int(os.environ.get("PBOX_LEAK_CYCLES", "250"))
CONCURRENCY = int(os.environ.get("PBOX_LEAK_CONCURRENCY", "6"))
# glibc's per-thread arenas (gRPC and per-sandbox reader threads) keep growing their resident
# high-water mark for the first few hundred cycles: the baseline is taken after that.
WARMUP = int(os.environ.get("PBOX_LEAK_WARMUP", str(max(200, CYCLES // 10))))


def _children() -> Dict[int, List[int]]:
    kids: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _descendants(pid: int) -> List[int]:
    kids = _children()
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _netns(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def _all_netns() -> Set[str]:
    return {ns for e in os.listdir("/proc") if e.isdigit() for ns in [_netns(int(e))] if ns}


def _cgroup_dirs(agent_pid: int, parent_name: str) -> List[str]:
    """The sandbox parent cgroup in every hierarchy: <mount><agent's cgroup>/<parent_name>."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, right = line.split(" - ", 1)
            if right.split()[0] in ("cgroup", "cgroup2"):
                mounts.append(left.split()[4])
    own = set()
    with open(f"/proc/{agent_pid}/cgroup") as f:
        for line in f:
            own.add(line.rstrip("\n").split(":", 2)[2])
    return sorted({f"{m}{p.rstrip('/')}/{parent_name}" for m in mounts for p in own
                   if os.path.isdir(f"{m}{p.rstrip('/')}/{parent_name}")})


def _sandbox_mount(line: str, root: str) -> bool:
    # Every mount of this agent's sandboxes is under its own root (state dir); other agents
    # on the machine mount under theirs.
    return root in line


def _walk(root: str) -> List[str]:
    out = []
    for d, dirs, files in os.walk(root):
        out += [os.path.join(d, x) for x in dirs + files]
    return sorted(out)


class Snapshot:
    def __init__(self, agent, parent_name: str) -> None:
        pid = agent.pid
        desc = _descendants(pid)
        self.processes = len(desc)
        with open("/proc/self/mountinfo") as f:
            host = f.read().splitlines()
        with open(f"/proc/{pid}/mountinfo") as f:
            own = f.read().splitlines()
        # The agent shares the host's mount namespace, where everyone else on the machine
        # mounts too: count what can only be this agent's (under its root); the totals are
        # reported, not compared.
        self.host_mounts = sum(_sandbox_mount(m, str(agent.root)) for m in host)
        self.agent_mounts = sum(_sandbox_mount(m, str(agent.root)) for m in own)
        self.host_mounts_total = len(host)
        self.agent_mounts_total = len(own)
        self.nsfs_mounts = sum(" - nsfs " in m for m in host)
        self.cgroup_dirs = _cgroup_dirs(pid, parent_name)
        self.cgroups = sum(len([e for e in os.scandir(d) if e.is_dir()])
                           for d in self.cgroup_dirs)
        agent_ns = _netns(pid)
        self.netns = len({_netns(p) for p in desc} - {"", agent_ns})
        fds = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                fds.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
        self.fds = len(fds)
        self.fd_targets = fds
        self.fd_netns = sum(t.startswith("net:") for t in fds)
        self.state = _walk(str(agent.state_dir))
        self.rss = agent.rss_bytes()
        self.host_netns = len(_all_netns())

    def leftovers(self, before: "Snapshot") -> dict:
        return {
            "processes": self.processes,
            "host_mounts": self.host_mounts - before.host_mounts,
            "agent_mounts": self.agent_mounts - before.agent_mounts,
            "cgroups": self.cgroups,
            "netns": self.netns,
            "fd_netns": self.fd_netns,
            "fds": self.fds - before.fds,
            "new_fd_targets": sorted(set(self.fd_targets) - set(before.fd_targets)),
            "state": sorted(set(self.state) - set(before.state)),
        }


def _cycle(client: pbox.Client, i: int) -> None:
    sb = client.create(runtime=RUNTIME, memory="64M", disk="16M")
    try:
        r = sb.run(["sh", "-c", f"echo {i} > /tmp/n && cat /tmp/n"], timeout=60)
        assert r.ok and r.stdout == f"{i}\n".encode(), r
    finally:
        sb.destroy()


def _run_cycles(agent, n: int) -> None:
    """n cycles through a client of their own, closed at the end: the agent's fds for the
    client's connections go with it, so that what stays is what the cycles left."""
    with agent.client() as client, ThreadPoolExecutor(CONCURRENCY) as pool:
        for f in [pool.submit(_cycle, client, i) for i in range(n)]:
            f.result()


def _settled(agent, parent: str, before: Snapshot, deadline_s: float = 20.0) -> Snapshot:
    """Destroy is synchronous, but gRPC threads and fds wind down a moment later: poll."""
    deadline = time.monotonic() + deadline_s
    while True:
        after = Snapshot(agent, parent)
        left = after.leftovers(before)
        clean = all(v <= 0 if isinstance(v, int) else k == "new_fd_targets" or not v
                    for k, v in left.items())
        if clean or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def test_cycles_leave_nothing_behind(make_agent) -> None:
    parent = f"pbox-leak-{secrets.token_hex(4)}"
    agent = make_agent(extra=["--max-sandboxes", str(4 * CONCURRENCY), "--cgroup-parent", parent]
                       + AGENT_ARGS)
    empty = Snapshot(agent, parent)
    assert empty.cgroup_dirs, "the sandbox parent cgroup was not found: the count proves nothing"
    # The counters see a live sandbox (else a leak could not show either).
    with agent.client() as client:
        sb = client.create(runtime=RUNTIME, memory="64M")
        live = Snapshot(agent, parent)
        assert live.processes >= 1 and live.cgroups >= 1 and live.netns >= 1, vars(live)
        sb.destroy()

    _run_cycles(agent, WARMUP)
    before = _settled(agent, parent, empty)
    assert before.processes == 0 and before.cgroups == 0, vars(before)

    t0 = time.monotonic()
    _run_cycles(agent, CYCLES)
    elapsed = time.monotonic() - t0
    after = _settled(agent, parent, before)
    left = after.leftovers(before)
    report = {
        "runtime": RUNTIME, "cycles": CYCLES, "warmup": WARMUP, "concurrency": CONCURRENCY,
        "seconds": round(elapsed, 1), "cycles_per_second": round(CYCLES / elapsed, 1),
        "rss_before_mib": round(before.rss / 2**20, 1),
        "rss_after_mib": round(after.rss / 2**20, 1),
        "fds_before": before.fds, "fds_after": after.fds,
        "host_netns_before": before.host_netns, "host_netns_after": after.host_netns,
        "nsfs_mounts_before": before.nsfs_mounts, "nsfs_mounts_after": after.nsfs_mounts,
        "host_mounts_total_before": before.host_mounts_total,
        "host_mounts_total_after": after.host_mounts_total,
        "leftovers": left, "load_average": os.getloadavg(),
    }
    print(json.dumps(report), file=sys.stderr)
    path = os.environ.get("PBOX_LEAK_REPORT")
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.rename(path + ".tmp", path)

    assert left["processes"] == 0, left
    assert after.host_mounts == 0 and after.agent_mounts == 0, left
    assert left["cgroups"] == 0, left
    assert left["netns"] == 0 and left["fd_netns"] == 0, left
    assert left["state"] == [], left
    assert left["fds"] <= 0, report
    assert after.rss <= before.rss * 1.10, report
    assert agent.alive()
    with agent.client() as client:
        assert client.health().serving
        assert client.info().live_sandboxes == 0
