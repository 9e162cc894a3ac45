"""pbox under a real Slurm on this machine: munged, slurmctld and slurmd with a generated config
in a temp dir, an sbatch job that starts agents with deploy/slurm/pbox-slurm, runs sandboxes
through pbox.ClusterClient and checks the CPU split, then scancel while 20 sandboxes run: within
5 s nothing of pbox remains (processes, cgroup dirs, state dirs).

Skips (with the reason) without root or without slurm-wlm/munge installed (scripts/deps/slurm.txt).
$PBOXD names the agent binary, $PYTHONPATH the built pbox package (ctest sets both).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "pbox" / "python"))
import rootless_user  # noqa: E402  (the test user and its delegated cgroup)
LAUNCHER = REPO / "deploy" / "slurm" / "pbox-slurm"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "srun", "scontrol")


def _find_pboxd() -> Optional[str]:
    env = os.environ.get("PBOXD")
    if env:
        return env
    for build in ("build", "build-slurm"):
        p = REPO / build / "src" / "pbox" / "pboxd"
        if p.exists():
            return str(p)
    return None


def _pythonpath(pboxd: str) -> str:
    for p in os.environ.get("PYTHONPATH", "").split(":"):
        if p and (Path(p) / "pbox" / "_proto").is_dir():
            return os.path.abspath(p)
    return str(Path(pboxd).resolve().parents[2] / "python")


def _free_port() -> int:
    """A port free now, below the kernel's ephemeral range: slurmctld and slurmd bind it a moment
    later, and a port from that range may meanwhile become the local end of any connection the
    tests running beside this one open (seen in CI: slurmctld's "Address already in use")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low = int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range below: any free port, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class SlurmCluster:
    """munged + slurmctld + slurmd on this host, everything under `root` (owned; stop() ends
    the daemons it started, by pid, and removes nothing else)."""

    def __init__(self, root: Path, two_nodes: bool = False, job_user=None) -> None:
        self.root = root
        # Jobs of an ordinary user (sbatch --uid): what the user's processes must reach (the
        # munge socket, the job's spool dir) is traversable by others, as in a packaged
        # install; slurmd runs in a cgroup delegated to that user (rootless_user), which is
        # where its job steps stay under proctrack/linuxproc.
        self.job_user = job_user
        self.delegated = None
        self.node = socket.gethostname().split(".")[0]
        self.procs: Dict[str, subprocess.Popen] = {}
        # Two nodes: this host's slurmd on one end of a veth pair, a second slurmd (node
        # "pbxn2") in a network namespace on the other end.
        self.two_nodes = two_nodes
        tag = os.urandom(3).hex()
        self.netns, self.veth = f"pbx-{tag}", f"pbx{tag}"
        self.subnet = f"10.251.{int(tag[:2], 16)}"
        self.addr1 = f"{self.subnet}.1" if two_nodes else "127.0.0.1"
        self.addr2 = f"{self.subnet}.2"
        self.node2 = "pbxn2"
        self.net_made = False
        self.env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
        for k in list(self.env):
            if k.startswith("SLURM_") and k != "SLURM_CONF":
                del self.env[k]

    def write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge", "tmp"):
            (r / d).mkdir(mode=0o700)
        for n in (self.node, self.node2):
            (r / "spool" / n).mkdir(mode=0o700)
        if self.job_user is not None:
            for d in ("spool", f"spool/{self.node}", "munge"):
                os.chmod(r / d, 0o755)
            os.chmod(r / "tmp", 0o1777)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ncpus = os.cpu_count() or 1
        (r / "slurm.conf").write_text(textwrap.dedent(f"""\
            ClusterName=pboxci
            FirstJobId={int.from_bytes(os.urandom(3), "big") + 1000}
            SlurmctldHost={self.node}({self.addr1})
            SlurmctldPort={_free_port()}
            SlurmdPort={_free_port()}
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={r}/munge/munge.sock
            StateSaveLocation={r}/state
            SlurmdSpoolDir={r}/spool/%n
            SlurmctldPidFile={r}/slurmctld.pid
            SlurmdPidFile={r}/slurmd-%n.pid
            SlurmctldLogFile={r}/log/slurmctld.log
            SlurmdLogFile={r}/log/slurmd-%n.log
            SlurmctldDebug=info
            SlurmdDebug=info
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/affinity
            SelectType=select/cons_tres
            SelectTypeParameters=CR_CPU
            SchedulerType=sched/builtin
            JobCompType=jobcomp/none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            MpiDefault=none
            ReturnToService=2
            KillWait=10
            InactiveLimit=0
            MinJobAge=2
            SlurmctldTimeout=30
            SlurmdTimeout=30
            TmpFS={r}/tmp
            NodeName={self.node} NodeAddr={self.addr1} CPUs={ncpus} State=UNKNOWN
            """))
        nodes = self.node
        if self.two_nodes:
            nodes += f",{self.node2}"
            with open(r / "slurm.conf", "a") as f:
                f.write(f"NodeName={self.node2} NodeAddr={self.addr2} CPUs={ncpus} "
                        "State=UNKNOWN\n")
        with open(r / "slurm.conf", "a") as f:
            f.write(f"PartitionName=ci Nodes={nodes} Default=YES MaxTime=10 State=UP "
                    "OverSubscribe=NO\n")
        (r / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _spawn(self, name: str, argv: List[str], preexec=None) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=self.env,
                                            preexec_fn=preexec)
        log.close()

    def start(self) -> None:
        self.write_config()
        r = self.root
        self._spawn("munged", ["munged", "-F", "-f", f"--key-file={r}/munge/munge.key",
                               f"--socket={r}/munge/munge.sock",
                               f"--pid-file={r}/munge/munged.pid",
                               f"--log-file={r}/log/munged.log",
                               f"--seed-file={r}/munge/munged.seed"])
        _wait(lambda: (r / "munge" / "munge.sock").exists() or self._dead("munged"), 10,
              "munged")
        self._check_alive("munged")
        if self.two_nodes:
            self.make_net()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(r / "slurm.conf")])
        if self.job_user is not None:
            self.delegated = rootless_user.DelegatedCgroup(self.job_user)
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node, "-f", str(r / "slurm.conf")],
                    preexec=self.delegated.enter if self.delegated else None)
        daemons = ["slurmctld", "slurmd"]
        if self.two_nodes:
            # nsenter --net only: `ip netns exec` would remount /sys and hide the cgroups.
            self._spawn("slurmd2", ["nsenter", f"--net=/run/netns/{self.netns}", "slurmd", "-D",
                                    "-N", self.node2, "-f", str(r / "slurm.conf")])
            daemons.append("slurmd2")
        want = ["idle"] * (2 if self.two_nodes else 1)

        def idle() -> bool:
            for n in daemons:
                self._check_alive(n)
            out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
            return out == want

        _wait(idle, 30, "the node to become idle", interval=0.3)

    def make_net(self) -> None:
        ns, va, vb = self.netns, self.veth + "a", self.veth + "b"
        cmds = [["ip", "netns", "add", ns],
                ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
                ["ip", "link", "set", vb, "netns", ns],
                ["ip", "addr", "add", f"{self.addr1}/24", "dev", va],
                ["ip", "link", "set", va, "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.addr2}/24", "dev", vb],
                ["ip", "-n", ns, "link", "set", vb, "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"]]
        self.net_made = True
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot make a network namespace with a veth pair: "
                            f"{' '.join(cmd)}: {r.stderr.strip()}")

    def remove_net(self) -> None:
        if self.net_made:
            subprocess.run(["ip", "link", "del", self.veth + "a"], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)

    def _dead(self, name: str) -> bool:
        return self.procs[name].poll() is not None

    def _check_alive(self, name: str) -> None:
        if self._dead(name):
            raise AssertionError(f"{name} exited ({self.procs[name].returncode}):\n"
                                 + self.logs(name))

    def logs(self, *names: str) -> str:
        out = []
        for n in names or ("munged", "slurmctld", "slurmd"):
            for f in (self.root / "log").glob(f"{n}*"):
                out.append(f"--- {f.name} ---\n" + f.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def run(self, argv: List[str], check: bool = True, timeout: float = 30) -> \
            subprocess.CompletedProcess:
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{argv} failed ({r.returncode}): {r.stderr}\n{self.logs()}")
        return r

    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--partition=ci"], check=False, timeout=10)
        for name in ("slurmd2", "slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.remove_net()
        if self.delegated is not None:
            left = self.delegated.remove()
            assert not left, f"cgroups left in the job user's delegated cgroup: {left}"


def _make_cluster(two_nodes: bool, rootless: bool = False):
    if os.geteuid() != 0:
        pytest.skip("needs root (slurmd, pboxd)")
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"slurm-wlm/munge not installed (missing {', '.join(missing)}); "
                    "install scripts/deps/slurm.txt")
    pboxd = _find_pboxd()
    if pboxd is None or not os.access(pboxd, os.X_OK):
        pytest.skip("pboxd not built: set $PBOXD")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to split between the job and its sandboxes")
    root = Path(tempfile.mkdtemp(prefix="pbx-slurm-", dir="/tmp"))
    os.chmod(root, 0o755)
    if two_nodes and (shutil.which("ip") is None or shutil.which("nsenter") is None):
        pytest.skip("iproute2/util-linux (ip, nsenter) missing")
    c = SlurmCluster(root, two_nodes, job_user=rootless_user.ensure_user() if rootless else None)
    c.pboxd = pboxd
    c.pythonpath = _pythonpath(pboxd)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        if os.environ.get("PBOX_SLURM_KEEP"):
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    yield from _make_cluster(two_nodes=False)


@pytest.fixture(scope="module")
def cluster2():
    yield from _make_cluster(two_nodes=True)


@pytest.fixture(scope="module")
def cluster_rootless():
    yield from _make_cluster(two_nodes=False, rootless=True)


JOB_PY = r'''
import json, os, sys, time
import pbox

out = sys.argv[1]
split = pbox.cpu_split()
sandbox = set(pbox.parse_cpu_list(split.sandbox))
trainer = set(pbox.parse_cpu_list(split.trainer))
os.sched_setaffinity(0, trainer)          # this process is part of the job: trainer CPUs
doc = json.load(open(os.environ["PBOX_ENDPOINTS"]))
agent_pids = [n["pid"] for n in doc["nodes"]]
res = {"split": [split.trainer, split.sandbox], "nodes": doc["nodes"]}

def descendants(pids):
    kids = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                ppid = int(open(f"/proc/{e}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(e))
    out, todo = [], list(pids)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out

def allowed(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return set(pbox.parse_cpu_list(line.split(":", 1)[1].strip()))

with pbox.ClusterClient() as cl:
    with cl.session(client_name="slurm-ci") as s:
        sbs = [s.create(memory="256M", disk="64M") for _ in range(4)]
        runs = [sb.run("grep Cpus_allowed_list /proc/self/status; sleep 2 & "
                       "sleep 0.2; grep -h Cpus_allowed_list /proc/*/status | sort -u")
                for sb in sbs]
        res["inside"] = [r.stdout.decode() for r in runs]
        res["inside_ok"] = all(r.ok for r in runs)
        procs = descendants(agent_pids)
        res["pbox_procs"] = {str(p): sorted(allowed(p) or []) for p in procs
                             if os.path.exists(f"/proc/{p}")}
        res["job_procs"] = {str(p): sorted(allowed(p) or []) for p in
                            [os.getpid(), os.getppid(), int(os.environ["TRAINER_PID"])]}
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.rename(out + ".tmp", out)
    # Phase 2: 20 sandboxes running when the job is cancelled.
    s = cl.session(client_name="slurm-ci-20")
    held = [s.create(memory="128M", disk="16M") for _ in range(20)]
    execs = [sb.exec(["sleep", "1000"]) for sb in held]
    time.sleep(0.3)
    n = sum(len(v) for v in s.list().values())
    with open(out + ".20.tmp", "w") as f:
        json.dump({"live": n, "procs": descendants(agent_pids)}, f)
    os.rename(out + ".20.tmp", out + ".20")  # the test polls for the name: publish it whole
    time.sleep(1000)
'''

JOB_SH = """#!/bin/bash
#SBATCH --job-name=pbox-ci
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --time=5
set -euo pipefail
export PBOXD={pboxd} PYTHONPATH={pythonpath}
export PBOX_ENDPOINTS=$({launcher} start --sandbox-cpus 1 --scratch {scratch} \\
    --run-dir {run_dir} --pboxd-arg=--max-sandboxes=64 --timeout 60)
trainer=$({launcher} cpus --role trainer)
echo "endpoints=$PBOX_ENDPOINTS trainer=$trainer sandbox=$({launcher} cpus --role sandbox)"
taskset -cp "$trainer" $$ >/dev/null   # this shell and all it starts: the trainer CPUs
taskset -c "$trainer" sleep 1000 &
export TRAINER_PID=$!
taskset -c "$trainer" /usr/bin/python3 {job_py} {result}
"""


def _pbox_leftovers(pboxd: str, scratch: Path, job: str) -> List[str]:
    """What of this job's pbox is still on the host: processes (pboxd and the launcher's node
    task name the job's scratch dir in their argv; pbox-init and sandbox commands sit in the
    job's cgroups), cgroup dirs, mounts, files in the scratch dir. Other tests' agents (same
    binary, run in parallel by ctest) do not count."""
    left = []
    tag = f"pbox-slurm-{job}-"
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace")
            with open(f"/proc/{e}/cgroup") as f:
                cg = f.read()
        except OSError:
            continue
        if str(scratch) in argv or tag in argv or tag in cg:
            left.append(f"process {e} {argv.replace(chr(0), ' ')[:200]}")

    def subdirs(d: str) -> List[str]:
        try:
            return [os.path.join(d, x) for x in os.listdir(d)
                    if os.path.isdir(os.path.join(d, x))]
        except OSError:  # removed while we look
            return []

    # Down to the agent's own cgroup, which may sit a few levels deep (e.g. a memory cgroup of
    # the session that started slurmd): the parent is created there.
    def walk(d: str, depth: int) -> None:
        for x in subdirs(d):
            if os.path.basename(x).startswith(f"pbox-slurm-{job}-"):
                left.append(f"cgroup {x}")
            elif depth < 3 and not os.path.basename(x).startswith("sb-"):
                walk(x, depth + 1)

    for base in subdirs("/sys/fs/cgroup"):
        walk(base, 1)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if str(scratch) in line or f"pbox-slurm-{job}-" in line:
            left.append(f"mount {line.split()[4]}")
    if scratch.exists() and any(scratch.iterdir()):
        left += [f"state {p}" for p in scratch.iterdir()]
    return left


def _scancel_leaves_nothing(cluster, job: str, scratch: Path, within: float, log) -> float:
    """scancel `job`, then waits until nothing of its pbox is left (fails after `within`
    seconds naming what is, with `log()`); returns the seconds it took."""
    t0 = time.monotonic()
    cluster.run(["scancel", job])
    left: List[str] = []

    def clean() -> bool:
        left[:] = _pbox_leftovers(cluster.pboxd, scratch, job)
        return not left

    try:
        _wait(clean, within, "pbox to be gone after scancel", interval=0.05)
    except AssertionError:
        raise AssertionError(f"left after {within:g} s: {left}\n{log()}") from None
    return time.monotonic() - t0


def test_job_split_and_scancel_cleanup(cluster) -> None:
    r = cluster.root
    scratch = r / "scratch"
    scratch.mkdir()
    result = r / "result.json"
    (r / "job.py").write_text(JOB_PY)
    (r / "job.sh").write_text(JOB_SH.format(
        pboxd=cluster.pboxd, pythonpath=cluster.pythonpath, launcher=LAUNCHER, scratch=scratch,
        run_dir=r / "run", job_py=r / "job.py", result=result))
    sub = cluster.run(["sbatch", "--parsable", f"--output={r}/job.out", f"--chdir={r}",
                       str(r / "job.sh")])
    job = sub.stdout.strip().split(";")[0]

    def job_log() -> str:
        try:
            return (r / "job.out").read_text(errors="replace")[-4000:] + \
                (r / "run" / "agents.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def done(path: Path):
        if path.exists():
            return True
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            raise AssertionError(f"job {job} ended ({state!r}) early:\n{job_log()}\n"
                                 f"{cluster.logs('slurmd')}")
        return False

    _wait(lambda: done(result), 60, "phase 1 of the job")
    res = json.loads(result.read_text())
    trainer_cpus, sandbox_cpus = res["split"]
    from pbox.cluster import parse_cpu_list
    sand, train = set(parse_cpu_list(sandbox_cpus)), set(parse_cpu_list(trainer_cpus))
    assert sand and train and not sand & train
    node = res["nodes"][0]
    job_cpus = set(parse_cpu_list(node["job_cpus"]))
    assert job_cpus == set(os.sched_getaffinity(0)) & set(range(os.cpu_count()))
    assert sand | train == job_cpus, res["split"]
    assert sand == {max(job_cpus)}  # --sandbox-cpus 1: the LAST CPU
    assert node["host"] == "127.0.0.1" and node["cpuset"] == sandbox_cpus
    assert node["endpoint"].startswith("tcp://127.0.0.1:")
    token = Path(node["token_file"])
    assert (token.stat().st_mode & 0o777) == 0o600 and len(token.read_text().strip()) >= 32
    assert res["inside_ok"], res["inside"]
    for text in res["inside"]:  # every process seen inside each sandbox
        lines = [ln for ln in text.splitlines() if ln.startswith("Cpus_allowed_list")]
        assert lines
        for ln in lines:
            assert set(parse_cpu_list(ln.split(":", 1)[1].strip())) <= sand, text
    # pboxd, every pbox-init and every command (host view): only the sandbox CPUs.
    assert len(res["pbox_procs"]) >= 1 + 4, res["pbox_procs"]
    for pid, cpus in res["pbox_procs"].items():
        assert set(cpus) <= sand, f"pbox process {pid} may run on {cpus}"
    for pid, cpus in res["job_procs"].items():
        assert set(cpus) == train, f"job process {pid} has {cpus}, trainer set is {train}"

    _wait(lambda: done(Path(str(result) + ".20")), 60, "20 sandboxes")
    twenty = json.loads(Path(str(result) + ".20").read_text())
    assert twenty["live"] == 20
    assert _pbox_leftovers(cluster.pboxd, scratch, job)  # things of pbox exist now
    elapsed = _scancel_leaves_nothing(cluster, job, scratch, 5.0, job_log)
    print(f"scancel -> nothing of pbox left after {elapsed:.2f} s")
    for pid in twenty["procs"]:
        assert not os.path.exists(f"/proc/{pid}") or \
            Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


STOP_SH = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --time=5
set -euo pipefail
export PBOXD={pboxd} PYTHONPATH={pythonpath}
L={launcher}
ep=$($L start --sandbox-cpus 1 --scratch {scratch} --run-dir {run_dir} --timeout 60)
pid=$(/usr/bin/python3 -c 'import json, sys
print(json.load(open(sys.argv[1]))["nodes"][0]["pid"])' $ep)
PBOX_ENDPOINTS=$ep /usr/bin/python3 -c '
import pbox
c = pbox.ClusterClient()
sb = c.create(memory="128M", disk="16M")   # detached: only the agent ending removes it
assert sb.run("echo ok").stdout == b"ok\\n"
'
if $L start --sandbox-cpus 1 --run-dir {run_dir} 2>/dev/null; then
  echo "second start worked"; exit 1
fi
$L stop --run-dir {run_dir}
if kill -0 $pid 2>/dev/null; then echo "pboxd $pid still there"; exit 1; fi
test ! -e {run_dir}/endpoints.json
ls -A {scratch}
# Started again, then the job just exits: the step ends with it.
$L start --sandbox-cpus 1 --scratch {scratch} --run-dir {run_dir} --timeout 60 >/dev/null
echo phase2
"""


def test_stop_and_normal_job_exit_leave_nothing(cluster) -> None:
    r = cluster.root / "stopjob"
    r.mkdir()
    scratch = r / "scratch"
    scratch.mkdir()
    (r / "job.sh").write_text(STOP_SH.format(pboxd=cluster.pboxd, pythonpath=cluster.pythonpath,
                                             launcher=LAUNCHER, scratch=scratch,
                                             run_dir=r / "run"))
    sub = cluster.run(["sbatch", "--parsable", f"--output={r}/job.out", f"--chdir={r}",
                       str(r / "job.sh")])
    job = sub.stdout.strip().split(";")[0]

    def finished() -> bool:
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()
        return state == ""

    _wait(finished, 60, f"job {job} to finish", interval=0.2)
    out = (r / "job.out").read_text(errors="replace")
    assert "phase2" in out, out + (r / "run" / "agents.log").read_text(errors="replace")
    # After `stop`, the scratch dir was empty (ls -A printed nothing before phase2).
    assert out.strip().endswith("phase2") and "still there" not in out, out
    _wait(lambda: not _pbox_leftovers(cluster.pboxd, scratch, job), 10,
          f"nothing of pbox after job {job} exited: "
          f"{_pbox_leftovers(cluster.pboxd, scratch, job)}")


EXAMPLE_TRAIN_PY = r'''
import json, os, sys
import pbox
with pbox.ClusterClient() as cluster, cluster.session(client_name="example") as s:
    out = s.create().run(["sh", "-c", "echo $((6*7))"], timeout=60).stdout.decode().strip()
json.dump({"out": out, "pbox": pbox.__file__,
           "pbox_slurm": os.popen("command -v pbox-slurm").read().strip(),
           "cpus": sorted(os.sched_getaffinity(0))}, open(sys.argv[1], "w"))
'''


def test_example_sbatch_job_runs_from_an_installed_prefix(cluster) -> None:
    """deploy/slurm/rl-job.sbatch, the example users start from, run as it is from a
    `cmake --install` prefix: pbox-slurm, pboxd and the pbox package all come from the prefix
    (none from the checkout or the build tree); only its #SBATCH lines (4 GPU nodes) are the
    test's own."""
    r = cluster.root / "example"
    r.mkdir()
    os.chmod(r, 0o755)
    build = Path(cluster.pboxd).resolve().parents[2]
    prefix = r / "prefix"
    subprocess.run(["cmake", "--install", str(build), "--prefix", str(prefix)], check=True,
                   capture_output=True, timeout=120)
    example = (prefix / "share" / "bragg" / "deploy" / "slurm" / "rl-job.sbatch").read_text()
    body = [ln for ln in example.splitlines() if not ln.startswith("#SBATCH")]
    assert len(body) < len(example.splitlines())
    (r / "job.sh").write_text("\n".join(
        [body[0], "#SBATCH --job-name=rl-example", "#SBATCH --nodes=1", "#SBATCH --exclusive",
         "#SBATCH --time=5"] + body[1:]) + "\n")
    (r / "train.py").write_text(EXAMPLE_TRAIN_PY)
    result = r / "result.json"
    scratch = r / "scratch"
    scratch.mkdir()
    # The job sees neither the checkout's PYTHONPATH nor the build's PBOXD: only BRAGG_PREFIX.
    env = {k: v for k, v in cluster.env.items() if k not in ("PYTHONPATH", "PBOXD")}
    env.update(BRAGG_PREFIX=str(prefix), SANDBOX_CPUS="1", TMPDIR=str(scratch),
               TRAIN_CMD=f"/usr/bin/python3 {r / 'train.py'} {result}")
    sub = subprocess.run(["sbatch", "--parsable", f"--output={r}/job.out", f"--chdir={r}",
                          "--export=ALL", str(r / "job.sh")], env=env, capture_output=True,
                         text=True, timeout=30, check=True)
    job = sub.stdout.strip().split(";")[0]

    def finished() -> bool:
        state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip()
        return state == ""

    def log() -> str:
        return (r / "job.out").read_text(errors="replace")[-4000:] if (r / "job.out").exists() \
            else ""

    _wait(finished, 120, f"the example job {job}:\n{log()}")
    assert result.exists(), f"the example job {job} did not run TRAIN_CMD:\n{log()}"
    res = json.loads(result.read_text())
    assert res["out"] == "42", res
    assert res["pbox"].startswith(str(prefix) + "/"), res
    assert res["pbox_slurm"] == str(prefix / "bin" / "pbox-slurm"), res
    assert res["cpus"] != sorted(os.sched_getaffinity(0)), "the trainer was not kept off the " \
        "sandbox CPU"
    _wait(lambda: not _pbox_leftovers(str(prefix / "bin" / "pboxd"), scratch, job), 20,
          f"nothing of pbox after the example job {job}")


def test_launcher_refuses_outside_a_job(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = subprocess.run(["/usr/bin/python3", str(LAUNCHER), "start", "--sandbox-cpus", "1"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)
    assert r.returncode != 0 and "not inside a Slurm job" in r.stderr


def test_cpus_command_splits_and_rejects(tmp_path) -> None:
    pboxd = _find_pboxd()
    if pboxd is None:
        pytest.skip("pboxd not built: set $PBOXD")
    env = dict(os.environ, PYTHONPATH=_pythonpath(pboxd))
    env.pop("PBOX_ENDPOINTS", None)

    def cpus(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["/usr/bin/python3", str(LAUNCHER), "cpus", *args],
                              capture_output=True, text=True, env=env, timeout=30)

    r = cpus("--role", "sandbox", "--job-cpus", "0-7", "--sandbox-cpus", "3")
    assert r.returncode == 0 and r.stdout.strip() == "5-7", r.stderr
    r = cpus("--role", "trainer", "--job-cpus", "0-7", "--sandbox-cpus", "3")
    assert r.returncode == 0 and r.stdout.strip() == "0-4", r.stderr
    r = cpus("--role", "trainer", "--job-cpus", "0-7", "--sandbox-cpus", "1,6")
    assert r.returncode == 0 and r.stdout.strip() == "0,2-5,7", r.stderr
    for bad in (["--sandbox-cpus", "8"], ["--sandbox-cpus", "0-7"], ["--sandbox-cpus", "x"]):
        r = cpus("--role", "trainer", "--job-cpus", "0-7", *bad)
        assert r.returncode == 2 and r.stderr, (bad, r.stdout)
    ep = tmp_path / "endpoints.json"
    ep.write_text(json.dumps({"nodes": [{"node": "nX", "endpoint": "tcp://127.0.0.1:1",
                                         "cpuset": "6-7", "trainer_cpus": "0-5"}]}))
    env["SLURMD_NODENAME"] = "nX"
    r = cpus("--role", "trainer", "--endpoints-file", str(ep))
    assert r.returncode == 0 and r.stdout.strip() == "0-5", r.stderr


TWO_PY = r'''
import json, sys
import pbox

doc = json.load(open(sys.argv[2]))
with pbox.ClusterClient(endpoints_file=sys.argv[2]) as cl:
    with cl.session(client_name="two-nodes") as s:
        sbs = [s.create(memory="128M", disk="16M") for _ in range(4)]
        named = s.create(node="pbxn2", memory="128M", disk="16M")
        outs = [sb.run("echo hi").stdout.decode() for sb in sbs + [named]]
        per_node = {n: sorted(x.id for x in v) for n, v in s.list().items()}
        res = {"nodes": doc["nodes"], "placed": [sb.node for sb in sbs], "named": named.node,
               "outs": outs, "per_node": per_node,
               "ids": {sb.id: sb.node for sb in sbs + [named]}}
    res["after"] = {n: len(v) for n, v in cl.list().items()}
json.dump(res, open(sys.argv[1], "w"))
'''

TWO_SH = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --exclusive
#SBATCH --time=5
set -euo pipefail
export PBOXD={pboxd} PYTHONPATH={pythonpath}
ep=$({launcher} start --sandbox-cpus 1 --scratch {scratch} --run-dir {run_dir} --timeout 60)
/usr/bin/python3 {two_py} {result} $ep
"""


def test_two_nodes_in_network_namespaces(cluster2) -> None:
    c = cluster2
    r = c.root / "two"
    r.mkdir()
    scratch = r / "scratch"
    scratch.mkdir()
    result = r / "result.json"
    (r / "two.py").write_text(TWO_PY)
    (r / "job.sh").write_text(TWO_SH.format(pboxd=c.pboxd, pythonpath=c.pythonpath,
                                            launcher=LAUNCHER, scratch=scratch,
                                            run_dir=r / "run", two_py=r / "two.py",
                                            result=result))
    job = c.run(["sbatch", "--parsable", f"--output={r}/job.out", f"--chdir={r}",
                 str(r / "job.sh")]).stdout.strip().split(";")[0]

    def finished() -> bool:
        return c.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip() == ""

    _wait(finished, 90, f"two-node job {job} to finish", interval=0.2)

    def logs() -> str:
        out = []
        for f in (r / "job.out", r / "run" / "agents.log"):
            if f.exists():
                out.append(f.read_text(errors="replace")[-3000:])
        return "\n".join(out) + c.logs("slurmd")

    assert result.exists(), logs()
    res = json.loads(result.read_text())
    hosts = {n["node"]: n["host"] for n in res["nodes"]}
    assert hosts == {c.node: c.addr1, c.node2: c.addr2}, hosts
    for n in res["nodes"]:
        assert n["endpoint"] == f"tcp://{n['host']}:{n['port']}"
    # Least loaded: the four spread two and two; the named one sits on pbxn2.
    assert sorted(res["placed"]) == sorted([c.node, c.node, c.node2, c.node2]), res["placed"]
    assert res["named"] == c.node2
    assert res["outs"] == ["hi\n"] * 5
    # Each agent really holds the sandboxes the client says it put there.
    for sid, node in res["ids"].items():
        assert sid in res["per_node"][node], (sid, node, res["per_node"])
    assert res["after"] == {c.node: 0, c.node2: 0}
    _wait(lambda: not _pbox_leftovers(c.pboxd, scratch, job), 10,
          f"nothing of pbox after job {job}: {_pbox_leftovers(c.pboxd, scratch, job)}")


CRASH_SH = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --time=5
set -euo pipefail
export PBOXD={pboxd} PYTHONPATH={pythonpath}
export PBOX_ENDPOINTS=$({launcher} start --sandbox-cpus 1 --scratch {scratch} --run-dir {run_dir})
/usr/bin/python3 -c '
import json, pbox, time
with pbox.ClusterClient() as cl, cl.session() as s:
    sbs = [s.create(memory="128M", disk="16M") for _ in range(5)]
    ps = [sb.exec(["sleep", "1000"]) for sb in sbs]
    open("{marker}", "w").write("ready")
    time.sleep(1000)
' || true
sleep 1000
"""


def test_agent_killed_hard_leaves_nothing(cluster) -> None:
    """SIGKILL of pboxd (OOM killer, a crash): the sandboxes go (their PID 1 sees the channel
    close), and the launcher's node task removes the cgroups and the state dir."""
    r = cluster.root / "crash"
    r.mkdir()
    scratch, marker = r / "scratch", r / "ready"
    scratch.mkdir()
    (r / "job.sh").write_text(CRASH_SH.format(pboxd=cluster.pboxd,
                                              pythonpath=cluster.pythonpath, launcher=LAUNCHER,
                                              scratch=scratch, run_dir=r / "run", marker=marker))
    job = cluster.run(["sbatch", "--parsable", f"--output={r}/job.out", f"--chdir={r}",
                       str(r / "job.sh")]).stdout.strip().split(";")[0]
    try:
        _wait(marker.exists, 60, f"5 sandboxes in job {job}: {r}/job.out")
        ep = json.loads((r / "run" / "endpoints.json").read_text())
        pid = ep["nodes"][0]["pid"]
        assert len(_pbox_leftovers(cluster.pboxd, scratch, job)) > 5
        os.kill(pid, signal.SIGKILL)
        left: List[str] = []

        def clean() -> bool:
            left[:] = _pbox_leftovers(cluster.pboxd, scratch, job)
            return not left

        try:
            _wait(clean, 5.0, "cleanup after SIGKILL of pboxd", interval=0.05)
        except AssertionError:
            raise AssertionError(f"left 5 s after SIGKILL of pboxd: {left}") from None
    finally:
        cluster.run(["scancel", job], check=False)


TIMELIMIT_SH = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --time=1
set -euo pipefail
export PBOXD={pboxd} PYTHONPATH={pythonpath}
export PBOX_ENDPOINTS=$({launcher} start --sandbox-cpus 1 --scratch {scratch} --run-dir {run_dir})
/usr/bin/python3 -c '
import pbox
c = pbox.ClusterClient()
for _ in range(5):
    sb = c.create(memory="128M", disk="16M")   # detached: only the agent ending removes it
    assert sb.run(["sh", "-c", "sleep 1000 >/dev/null 2>&1 &"]).ok
open("{marker}", "w").write("ready")
'
sleep 1000
"""


def test_time_limit_leaves_nothing(cluster) -> None:
    """The job runs past its time limit (1 minute): Slurm ends its steps, the agents destroy
    their detached sandboxes (with a background process each) and exit, nothing remains."""
    r = cluster.root / "timelimit"
    r.mkdir()
    scratch, marker = r / "scratch", r / "ready"
    scratch.mkdir()
    (r / "job.sh").write_text(TIMELIMIT_SH.format(
        pboxd=cluster.pboxd, pythonpath=cluster.pythonpath, launcher=LAUNCHER,
        scratch=scratch, run_dir=r / "run", marker=marker))
    job = cluster.run(["sbatch", "--parsable", f"--output={r}/job.out", f"--chdir={r}",
                       str(r / "job.sh")]).stdout.strip().split(";")[0]
    try:
        _wait(marker.exists, 60, f"5 sandboxes in job {job}: {r}/job.out")
        assert len(_pbox_leftovers(cluster.pboxd, scratch, job)) > 5

        def state() -> str:
            out = cluster.run(["scontrol", "-o", "show", "job", job], check=False).stdout
            for field in out.split():
                if field.startswith("JobState="):
                    return field.split("=", 1)[1]
            return ""

        # Slurm checks time limits about every 30 s, then gives steps KillWait (10 s).
        _wait(lambda: state() not in ("RUNNING", "PENDING", "CONFIGURING"), 180,
              f"job {job} to pass its time limit", interval=0.5)
        assert state() in ("TIMEOUT", "COMPLETING"), state()
        left: List[str] = []

        def clean() -> bool:
            left[:] = _pbox_leftovers(cluster.pboxd, scratch, job)
            return not left

        try:
            _wait(clean, 15.0, "cleanup after the time limit", interval=0.1)
        except AssertionError:
            raise AssertionError(f"left after the time limit: {left}\n"
                                 f"{(r / 'job.out').read_text(errors='replace')}") from None
    finally:
        cluster.run(["scancel", job], check=False)


def test_bragg_rl_job_on_two_nodes(cluster2) -> None:
    """deploy/slurm/bragg-rl.sbatch as it is (only its #SBATCH lines are the test's), from a
    `cmake --install` prefix, on two Slurm nodes (the second in a network namespace of its
    own): a pboxd and a bragg-engine on each, bragg-rl with its gateway and trainer on the
    first node, the engines serving the run's weights and the rollouts' sandboxes on both
    agents. The run finishes its steps and nothing of pbox is left after the job."""
    c = cluster2
    r = c.root / "bragg-rl"
    r.mkdir()
    os.chmod(r, 0o755)
    build = Path(c.pboxd).resolve().parents[2]
    prefix = r / "prefix"
    subprocess.run(["cmake", "--install", str(build), "--prefix", str(prefix)], check=True,
                   capture_output=True, timeout=300)
    chaos = REPO / "tests" / "rl" / "chaos"
    task = r / "task"
    task.mkdir()
    shutil.copy(REPO / "python" / "bragg_rl" / "env.py", task / "env.py")
    shutil.copy(chaos / "chaos_env.py", task / "chaos_env.py")
    (task / "calm").write_text("")
    run = r / "run"
    # The chaos task's small run (tests/rl/chaos/config.toml.in), its engines the job's.
    (r / "rl.toml").write_text((chaos / "config.toml.in").read_text().format(
        run=run, steps=2, staleness=1, checkpoint_every=10, chaos=chaos, task=task,
        tool_timeout_s=5, engines=1, train_extra="", extra=""))
    example = (prefix / "share" / "bragg" / "deploy" / "slurm" / "bragg-rl.sbatch").read_text()
    body = [ln for ln in example.splitlines() if not ln.startswith("#SBATCH")]
    assert len(body) < len(example.splitlines())
    (r / "job.sh").write_text("\n".join(
        [body[0], "#SBATCH --job-name=bragg-rl-test", "#SBATCH --nodes=2",
         "#SBATCH --exclusive", "#SBATCH --time=8"] + body[1:]) + "\n")
    scratch = r / "scratch"
    scratch.mkdir()
    env = {k: v for k, v in c.env.items()
           if k not in ("PYTHONPATH", "PBOXD", "PBOX_ENDPOINT", "PBOX_ENDPOINTS")}
    port = _free_port()
    env.update(BRAGG_PREFIX=str(prefix), CONFIG=str(r / "rl.toml"), SANDBOX_CPUS="1",
               MAX_SANDBOXES="64", TMPDIR=str(scratch), ENGINE_PORT=str(port))
    # From r: pbox-slurm keeps its run directory in the submit directory.
    sub = subprocess.run(["sbatch", "--parsable", f"--output={r}/job.out", f"--chdir={r}",
                          "--export=ALL", str(r / "job.sh")], env=env, capture_output=True,
                         text=True, timeout=30, check=True, cwd=r)
    job = sub.stdout.strip().split(";")[0]

    def finished() -> bool:
        return c.run(["squeue", "-h", "-j", job, "-o", "%T"], check=False).stdout.strip() == ""

    def log() -> str:
        out = [(r / "job.out").read_text(errors="replace")[-4000:] if (r / "job.out").exists()
               else ""]
        rl_log = run / "logs"
        if rl_log.exists():
            out += [f.read_text(errors="replace")[-1500:] for f in sorted(rl_log.iterdir())]
        return "\n".join(out)

    try:
        _wait(finished, 240, f"the bragg-rl job {job}:\n{log()}", interval=0.5)
    finally:
        c.run(["scancel", job], check=False)
    summary = run / "summary.json"
    assert summary.exists(), f"bragg-rl did not finish in job {job}:\n{log()}"
    assert json.loads(summary.read_text())["steps"] == 2
    steps = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()
             if "event" not in json.loads(ln)]
    by_agent = steps[-1]["sandboxes_by_agent"]
    assert sorted(by_agent) == sorted([c.node, c.node2]), by_agent
    assert all(v > 0 for v in by_agent.values()), by_agent
    assert all(s["over_stale"] == 0 for s in steps)
    # The job's two engines, one per node, and none of bragg-rl's own; the trainer's log-probs
    # equal theirs on fresh trajectories (deterministic kernels): they serve the run's weights.
    fleet = json.loads((run / "fleet.json").read_text())
    assert sorted(fleet["workers"]) == sorted(f"http://{h}:{port}" for h in (c.addr1, c.addr2))
    assert not [s for s in fleet["servers"] if s["name"].startswith("engine")], fleet
    for s in steps:
        if s["agreement_samples"] > 0:
            assert s["logprob_agreement_max"] <= 1e-5, s
    _wait(lambda: not _pbox_leftovers(str(prefix / "bin" / "pboxd"), scratch, job), 20,
          f"nothing of pbox after the bragg-rl job {job}")


ROOTLESS_JOB_PY = r'''
import json, os, sys, time
import pbox

out = sys.argv[1]
doc = json.load(open(os.environ["PBOX_ENDPOINTS"]))
node = doc["nodes"][0]
res = {"node": node, "job_uid": os.getuid()}
for line in open(f"/proc/{node['pid']}/status"):
    if line.startswith(("Uid:", "Cpus_allowed_list:")):
        res[line.split(":")[0]] = line.split(":", 1)[1].split()
with open(node["token_file"]) as f:
    token = f.read().strip()
with pbox.Client(node["endpoint"], token=token) as c:
    info = c.info()
    res["info"] = {"mode": info.mode, "uid": info.uid, "limits": list(info.limits),
                   "runtimes": list(info.runtimes)}
with pbox.ClusterClient() as cl:
    s = cl.session(client_name="slurm-rootless")
    held = [s.create(memory="128M", disk="16M", pids=64) for _ in range(4)]
    r = held[0].run(["sh", "-c", "cat /proc/self/uid_map; id -u"], timeout=30)
    res["inside"] = r.stdout.decode().split()
    # The memory limit holds: a 200 MiB allocation in a 128 MiB sandbox is killed.
    bomb = held[1].run(["python3", "-c", "b = bytearray(200 << 20); print(len(b))"], timeout=60)
    res["bomb"] = {"ok": bomb.ok, "oom": bomb.oom_killed,
                   "stdout": bomb.stdout.decode()}
    execs = [sb.exec(["sleep", "1000"]) for sb in held]
    time.sleep(0.3)
    res["live"] = sum(len(v) for v in s.list().values())
    with open(out + ".tmp", "w") as f:
        json.dump(res, f)
    os.rename(out + ".tmp", out)
    time.sleep(1000)
'''

ROOTLESS_JOB_SH = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --time=5
set -euo pipefail
export PBOXD={pboxd} PYTHONPATH={pythonpath}
export PBOX_ENDPOINTS=$({launcher} start --sandbox-cpus 1 --scratch {scratch} \\
    --run-dir {run_dir} --timeout 60)
/usr/bin/python3 {job_py} {result}
"""


def test_a_job_users_agents_run_rootless(cluster_rootless) -> None:
    """A job of an ordinary user (sbatch --uid) on a node whose slurmd runs in a cgroup
    delegated to that user: pbox-slurm starts pboxd as the job's user, rootless, with no flag
    for it (docs/cluster.md); sandboxes get user namespaces and their limits hold; scancel
    leaves nothing of pbox, the agents' --reap having run as that user."""
    cluster = cluster_rootless
    user = cluster.job_user
    r = rootless_user.owned_tempdir(user)
    try:
        scratch = r / "scratch"
        scratch.mkdir()
        os.chown(scratch, user.pw_uid, user.pw_gid)
        result = r / "result.json"
        (r / "job.py").write_text(ROOTLESS_JOB_PY)
        (r / "job.sh").write_text(ROOTLESS_JOB_SH.format(
            pboxd=cluster.pboxd, pythonpath=cluster.pythonpath, launcher=LAUNCHER,
            scratch=scratch, run_dir=r / "run", job_py=r / "job.py", result=result))
        for f in ("job.py", "job.sh"):
            os.chmod(r / f, 0o755)
        sub = cluster.run(["sbatch", "--parsable", f"--uid={user.pw_uid}",
                           f"--gid={user.pw_gid}", f"--output={r}/job.out", f"--chdir={r}",
                           str(r / "job.sh")])
        job = sub.stdout.strip().split(";")[0]

        def job_log() -> str:
            out = []
            for f in (r / "job.out", r / "run" / "agents.log"):
                try:
                    out.append(f.read_text(errors="replace")[-4000:])
                except OSError:
                    pass
            return "\n".join(out)

        def done() -> bool:
            if result.exists():
                return True
            state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"],
                                check=False).stdout.strip()
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                raise AssertionError(f"job {job} ended ({state!r}) early:\n{job_log()}\n"
                                     f"{cluster.logs('slurmd')}")
            return False

        _wait(done, 90, "the rootless job's sandboxes")
        res = json.loads(result.read_text())
        uid = user.pw_uid
        assert res["job_uid"] == uid, res
        # pboxd is the job user's (real, effective, saved, fs), and says it runs rootless.
        assert res["Uid"] == [str(uid)] * 4, res
        assert res["info"]["mode"] == "rootless" and res["info"]["uid"] == uid, res["info"]
        assert res["info"]["runtimes"] == ["native"], res["info"]
        assert {"memory", "pids", "cpuset"} <= set(res["info"]["limits"]), res["info"]
        # Inside: root of a user namespace mapped to the job user alone.
        assert res["inside"] == ["0", str(uid), "1", "0"], res["inside"]
        assert res["bomb"]["oom"] and not res["bomb"]["stdout"], res["bomb"]
        assert res["live"] == 4, res
        # The agent's token and endpoints are the job user's.
        token = Path(res["node"]["token_file"])
        st = token.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (uid, 0o600), oct(st.st_mode)
        assert _pbox_leftovers(cluster.pboxd, scratch, job)  # things of pbox exist now
        _scancel_leaves_nothing(cluster, job, scratch, 10.0, job_log)
        log = (r / "run" / "agents.log").read_text(errors="replace")
        assert "mode rootless" in log, log[-3000:]
    finally:
        shutil.rmtree(r, ignore_errors=True)


AS_ROOT_JOB_SH = """#!/bin/bash
#SBATCH --nodes=1
#SBATCH --exclusive
#SBATCH --time=5
set -euo pipefail
export PBOXD={pboxd} PYTHONPATH={pythonpath}
L={launcher}
ep=$($L start --as-root "sudo -n" --sandbox-cpus 1 --scratch {scratch} --run-dir {run_dir} \\
    --timeout 60)
PBOX_ENDPOINTS=$ep /usr/bin/python3 -c '
import json, os, pbox
node = json.load(open(os.environ["PBOX_ENDPOINTS"]))["nodes"][0]
uid = [l.split()[1] for l in open("/proc/%d/status" % node["pid"]) if l.startswith("Uid:")][0]
with pbox.Client(node["endpoint"], token=open(node["token_file"]).read().strip()) as c:
    info = c.info()
with pbox.ClusterClient() as cl:
    out = cl.create(memory="128M", disk="16M").run(["id", "-u"], timeout=30).stdout.decode()
print("agent", info.mode, info.uid, uid, "inside", out.strip(), "job", os.getuid())
'
$L stop --run-dir {run_dir}
echo "scratch: $(ls -A {scratch})."
"""


def test_as_root_runs_a_user_jobs_agents_as_root_and_leaves_nothing(cluster_rootless) -> None:
    """`pbox-slurm start --as-root "sudo -n"` in an ordinary user's job, with a sudoers line
    for pboxd alone (docs/cluster.md): the agent runs as root (root mode), the job's client
    reaches it over TCP with the token, and after `stop` its --reap --purge, run through sudo
    too, has removed the state dir the root agent made in the user's scratch."""
    if shutil.which("sudo") is None:
        pytest.skip("sudo not installed (scripts/deps/slurm.txt)")
    cluster = cluster_rootless
    user = cluster.job_user
    sudoers = Path(f"/etc/sudoers.d/pbox-slurm-test-{os.getpid()}")
    r = rootless_user.owned_tempdir(user)
    try:
        sudoers.write_text(f"{user.pw_name} ALL=(root) NOPASSWD: {cluster.pboxd}\n")
        os.chmod(sudoers, 0o440)
        scratch = r / "scratch"
        scratch.mkdir()
        os.chown(scratch, user.pw_uid, user.pw_gid)
        (r / "job.sh").write_text(AS_ROOT_JOB_SH.format(
            pboxd=cluster.pboxd, pythonpath=cluster.pythonpath, launcher=LAUNCHER,
            scratch=scratch, run_dir=r / "run"))
        os.chmod(r / "job.sh", 0o755)
        sub = cluster.run(["sbatch", "--parsable", f"--uid={user.pw_uid}",
                           f"--gid={user.pw_gid}", f"--output={r}/job.out", f"--chdir={r}",
                           str(r / "job.sh")])
        job = sub.stdout.strip().split(";")[0]

        def finished() -> bool:
            state = cluster.run(["squeue", "-h", "-j", job, "-o", "%T"],
                                check=False).stdout.strip()
            return state == ""

        _wait(finished, 90, f"job {job} to finish", interval=0.2)
        out = (r / "job.out").read_text(errors="replace")
        log = ""
        if (r / "run" / "agents.log").exists():
            log = (r / "run" / "agents.log").read_text(errors="replace")[-3000:]
        assert f"agent root 0 0 inside 0 job {user.pw_uid}" in out, out + log
        assert out.rstrip().endswith("scratch: ."), out + log
        _wait(lambda: not _pbox_leftovers(cluster.pboxd, scratch, job), 10,
              f"nothing of pbox after job {job}: "
              f"{_pbox_leftovers(cluster.pboxd, scratch, job)}")
    finally:
        sudoers.unlink(missing_ok=True)
        shutil.rmtree(r, ignore_errors=True)
