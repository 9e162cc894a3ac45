"""bragg-rl end to end, with faults: a real pboxd, two bragg-engine workers behind bragg-gateway,
the trainer in bragg-rl's process, and a task that misbehaves on purpose (chaos/chaos_env.py:
tool servers that crash, hang and run out of memory; a verifier that crashes).

- a run with every tool fault finishes its steps; faults are error observations and counted
  drops, never a failed run; no trajectory is trained beyond the staleness bound; the trainer's
  log-probs of fresh trajectories equal the engines' (deterministic kernels on both sides);
- kill -9 of the controller: its engines and gateway die with it; --resume continues from the
  last checkpoint and no trajectory is trained twice;
- an engine killed mid-run: the run goes on over the other;
- the pbox agent killed and restarted mid-run: the controller prepares its sandbox again;
- bad input refused at start, before any engine is started.

Needs root (pboxd). Binaries from BRAGG_BUILD (default: build/).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("BRAGG_BUILD", ROOT / "build")).resolve()
RL = BUILD / "src" / "rl" / "bragg-rl"
PBOXD = BUILD / "src" / "pbox" / "pboxd"
CHAOS = Path(__file__).resolve().parent / "chaos"
ENV_PY = ROOT / "python" / "bragg_rl" / "env.py"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="pboxd needs root")


class Agent:
    """A pboxd on a socket of its own; restartable on the same socket and state."""

    def __init__(self, root: Path):
        self.root = root
        self.sock = root / "pbox.sock"
        self.proc = None
        self.start()

    def start(self):
        ready = self.root / "ready"
        if ready.exists():
            ready.unlink()
        log = open(self.root / "pboxd.log", "ab")
        self.proc = subprocess.Popen(
            [str(PBOXD), "--listen", f"unix://{self.sock}", "--state-dir", str(self.root / "state"),
             "--ready-file", str(ready), "--max-sandboxes", "200", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while not ready.exists():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError((self.root / "pboxd.log").read_text()[-2000:])
            time.sleep(0.05)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = Agent(tmp_path_factory.mktemp("pbox"))
    yield a
    a.stop()


STARTED: list = []  # every bragg-rl this module started


@pytest.fixture(autouse=True)
def no_run_outlives_its_test():
    """A test that fails while bragg-rl runs would leave it (and its engines) eating the CPU
    of every test after it: killed at teardown."""
    yield
    while STARTED:
        p = STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


def task_dir(tmp: Path, calm: bool) -> Path:
    d = tmp / "task"
    d.mkdir(exist_ok=True)
    shutil.copy(ENV_PY, d / "env.py")
    shutil.copy(CHAOS / "chaos_env.py", d / "chaos_env.py")
    if calm:
        (d / "calm").write_text("")
    return d


def write_config(tmp: Path, *, steps=6, calm=False, staleness=1, checkpoint_every=2,
                 extra="", train_extra="") -> Path:
    task = task_dir(tmp, calm)
    text = (CHAOS / "config.toml.in").read_text().format(
        run=tmp / "run", steps=steps, staleness=staleness, checkpoint_every=checkpoint_every,
        chaos=CHAOS, task=task, tool_timeout_s=1, engines=2, train_extra=train_extra,
        extra=extra)
    path = tmp / "config.toml"
    path.write_text(text)
    return path


def start(config: Path, agent: Agent, *args) -> subprocess.Popen:
    env = dict(os.environ, PBOX_ENDPOINT=f"unix://{agent.sock}")
    log = open(config.parent / "bragg-rl.log", "ab")
    p = subprocess.Popen([str(RL), "run", str(config), *args], env=env, stdout=log,
                         stderr=subprocess.STDOUT)
    STARTED.append(p)
    return p


def log_tail(config: Path) -> str:
    return (config.parent / "bragg-rl.log").read_text(errors="replace")[-3000:]


def finish(p: subprocess.Popen, config: Path, timeout=300) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError("bragg-rl did not finish:\n" + log_tail(config))
    assert rc == 0, log_tail(config)


def steps_of(run: Path) -> list:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        j = json.loads(line)
        if "event" not in j:
            out.append(j)
    return out


def wait_for_step(run: Path, step: int, p: subprocess.Popen, config: Path, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if p.poll() is not None:
            raise AssertionError(f"bragg-rl exited {p.returncode}:\n" + log_tail(config))
        try:
            if steps_of(run) and steps_of(run)[-1]["step"] >= step:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s:\n" + log_tail(config))


def scrape(run: Path) -> dict:
    """bragg-rl's Prometheus /metrics (run.metrics_listen, default 127.0.0.1:0), as
    {"name{labels}": value}."""
    url = (run / "metrics_url").read_text().strip()
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4"
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def check_common(run: Path, staleness: int, steps: int) -> list:
    m = steps_of(run)
    assert [s["step"] for s in m] == list(range(1, steps + 1))
    for s in m:
        assert s["over_stale"] == 0
        assert max(int(k) for k in s["staleness"]) <= staleness
        # Deterministic kernels on both sides: the trainer's log-probs of trajectories sampled
        # wholly by its current weights are the engines', exactly.
        if s["agreement_samples"] > 0:
            assert s["logprob_agreement_max"] <= 1e-5, s
    trained = [json.loads(l) for l in (run / "trained.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(1, steps + 1))
    ids = [i for t in trained for i in t["ids"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps
    return m


VERIFIER_LINE = 'verifier = ["python3", "/task/chaos_env.py", "verify"]'


@pytest.mark.parametrize("scoring", ["verifier", "verifier_in_tool_server"])
def test_faults_are_observations_and_counted_drops(agent, tmp_path, scoring):
    config = write_config(tmp_path, steps=6)
    if scoring == "verifier_in_tool_server":
        # The reward that raises is the tool server's {"error"} reply: dropped the same way.
        text = config.read_text()
        assert VERIFIER_LINE in text
        config.write_text(text.replace(VERIFIER_LINE, "verifier_in_tool_server = true"))
    p = start(config, agent)
    finish(p, config)
    run = tmp_path / "run"
    m = check_common(run, 1, 6)
    failures = sum(s["tool_failures"] for s in m)
    dropped = {}
    for s in m:
        for k, v in s["dropped"].items():
            dropped[k] = dropped.get(k, 0) + v
    assert failures > 0, "no tool fault happened: the chaos task is too calm"
    assert dropped.get("verifier_failed", 0) > 0, dropped
    rollouts = [json.loads(l) for l in (run / "rollouts.jsonl").read_text().splitlines()]
    assert any(r["dropped"] == "verifier_failed" for r in rollouts)
    # Nothing is left behind: the engines and the gateway are gone, and so are the sandboxes.
    fleet = json.loads((run / "fleet.json").read_text())
    for s in fleet["servers"]:
        assert not alive(s["pid"]), s


PEER_PYTHON = os.environ.get("BRAGG_PEER_PYTHON", "")

# Under the Python peer environment: bragg-rl's exported rows through the Megatron adapter into
# megatron-core's PackedSeqParams (test_megatron_adapter.py checks the adapter itself against
# megatron-core's THD helpers).
MEGATRON_CHECK = r'''
import json, sys
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from bragg_rl.megatron import read_batches, megatron_batch
n = 0
for path in sys.argv[1:]:
    for row in read_batches(path):
        batch, params = megatron_batch(row, cp_size=2)
        assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
        T = batch["tokens"].shape[1]
        assert T % 4 == 0 and int(params.cu_seqlens_q_padded[-1]) == T
        assert float(batch["loss_mask"].sum()) > 0
        n += 1
print(json.dumps({"rows": n}))
'''


def test_exported_batches_load_into_megatron(agent, tmp_path):
    """[export] batches: every trained trajectory once per step, in rows padded for CP=2, that
    bragg_rl.megatron turns into megatron-core's PackedSeqParams."""
    if not PEER_PYTHON or not Path(PEER_PYTHON).exists():
        pytest.skip("no Python peer environment (BRAGG_PEER_PYTHON): run scripts/install-deps")
    config = write_config(tmp_path, steps=3, calm=True,
                          extra="\n[export]\nbatches = true\ncp = 2\nmax_tokens = 256\n")
    p = start(config, agent)
    finish(p, config)
    run = tmp_path / "run"
    check_common(run, 1, 3)
    trained = [json.loads(l) for l in (run / "trained.jsonl").read_text().splitlines()]
    files = []
    for t in trained:
        path = run / "batches" / f"step-{t['step']:06d}.jsonl"
        rows = [json.loads(l) for l in path.read_text().splitlines()]
        ids = [i for r in rows for i in r["trajectory_ids"]]
        assert sorted(ids) == sorted(t["ids"]), t["step"]
        for r in rows:
            assert r["step"] == t["step"] and r["version"] == t["version"]
            cup = r.get("cu_seqlens_padded", r["cu_seqlens"])
            assert len(r["tokens"]) == cup[-1] <= 256
            assert all((b - a) % 4 == 0 for a, b in zip(cup, cup[1:])), cup
        files.append(str(path))
    assert not list((run / "batches").glob("*.tmp"))
    out = subprocess.run([PEER_PYTHON, "-c", MEGATRON_CHECK, *files], capture_output=True,
                         text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(BUILD / "python")))
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["rows"] >= len(files)


def start_external_trainer(tmp: Path, steps: int) -> subprocess.Popen:
    """examples/external-trainer/train_hf.py for tmp/run's steps, logging to tmp/train_hf.log."""
    log = open(tmp / "train_hf.log", "wb")
    p = subprocess.Popen(
        [PEER_PYTHON, str(ROOT / "examples" / "external-trainer" / "train_hf.py"),
         str(tmp / "run"), "--steps", str(steps), "--lr", "0.05", "--timeout", "300"],
        stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(BUILD / "python")))
    STARTED.append(p)
    return p


def test_an_external_trainer_trains_and_its_weights_are_served(agent, tmp_path):
    """[train] external: bragg-rl exports each step's batch and waits; an external trainer
    (examples/external-trainer/train_hf.py, on transformers) trains on it and renames its weights
    into place; bragg-rl pushes them to the engines. Synchronous (max_staleness 0), so every
    token of batch k was sampled by version k-1: the external trainer's own log-probs of them,
    with the weights it wrote, equal the engines' behaviour log-probs. That holds only if the
    engines served exactly the external trainer's weights."""
    if not PEER_PYTHON or not Path(PEER_PYTHON).exists():
        pytest.skip("no Python peer environment (BRAGG_PEER_PYTHON): run scripts/install-deps")
    steps = 3
    config = write_config(tmp_path, steps=steps, calm=True, staleness=0,
                          train_extra="external = true\nexternal_timeout_s = 300\n")
    run = tmp_path / "run"
    p = start(config, agent)
    trainer = start_external_trainer(tmp_path, steps)
    finish(p, config)
    assert trainer.wait(timeout=120) == 0, (tmp_path / "train_hf.log").read_text()[-3000:]
    m = check_common(run, 0, steps)
    for k, s in enumerate(m, start=1):
        assert s["version"] == k
        assert s["loss"] is None and s["grad_norm"] is None  # the trainer's, not bragg-rl's
        assert s["agreement_samples"] == 0
    start_event = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()
                   if '"event":"start"' in l.replace(" ", "")]
    assert start_event and start_event[0]["trainer"] == "external"
    assert json.loads((run / "external_state.json").read_text())["version"] == steps
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
    report = [json.loads(l) for l in (run / "external" / "report.jsonl").read_text().splitlines()]
    assert [r["version"] for r in report] == list(range(1, steps + 1))
    for r in report:
        assert r["tokens"] > 0
        # fp32 transformers against the engine's deterministic fp32 kernels.
        assert r["logprob_agreement_max"] <= 1e-3, r
    # Batch k+1 was sampled by the engines with the weights the external trainer wrote at step k:
    # a step that moved the log-probs by far more than the agreement above shows the engines
    # served those weights and not the ones before.
    moved = [r for r in report[:-1] if r["logprob_change_max"] > 0.05]
    assert moved, report
    from_init = subprocess.run(
        [PEER_PYTHON, "-c", WEIGHTS_MOVED, str(run / "models" / "v0"),
         str(run / "external" / f"v{steps:06d}")], capture_output=True, text=True, timeout=120)
    assert from_init.returncode == 0, from_init.stderr[-2000:]
    assert float(from_init.stdout.strip()) > 0


WEIGHTS_MOVED = r'''
import sys
from safetensors.torch import load_file
import glob, os
def load(d):
    out = {}
    for f in glob.glob(os.path.join(d, "*.safetensors")):
        out.update(load_file(f))
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
common = set(a) & set(b)
assert common, (sorted(a)[:5], sorted(b)[:5])
print(max(float((a[k].float() - b[k].float()).abs().max()) for k in common))
'''


def test_kill_9_while_the_external_trainer_trains_then_resume(agent, tmp_path):
    """kill -9 of bragg-rl after it exported step 1's batch and before the weights came back:
    --resume keeps that batch (the external trainer may be training on it), waits for its
    weights, records its trajectories as step 1, and goes on; nothing is trained twice."""
    if not PEER_PYTHON or not Path(PEER_PYTHON).exists():
        pytest.skip("no Python peer environment (BRAGG_PEER_PYTHON): run scripts/install-deps")
    steps = 3
    config = write_config(tmp_path, steps=steps, calm=True, staleness=0,
                          train_extra="external = true\nexternal_timeout_s = 300\n")
    run = tmp_path / "run"
    first = run / "batches" / "step-000001.jsonl"
    p = start(config, agent)
    deadline = time.time() + 240
    while not first.exists():
        assert p.poll() is None and time.time() < deadline, log_tail(config)
        time.sleep(0.1)
    p.kill()
    p.wait()
    exported = [i for l in first.read_text().splitlines() for i in json.loads(l)["trajectory_ids"]]
    trainer = start_external_trainer(tmp_path, steps)
    p = start(config, agent, "--resume")
    finish(p, config)
    assert trainer.wait(timeout=120) == 0, (tmp_path / "train_hf.log").read_text()[-3000:]
    trained = [json.loads(l) for l in (run / "trained.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(1, steps + 1))
    assert sorted(trained[0]["ids"]) == sorted(exported)
    ids = [i for t in trained for i in t["ids"]]
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(j.get("event") == "resumed_step" and j["step"] == 1 for j in lines)
    assert [s["step"] for s in steps_of(run)] == list(range(2, steps + 1))
    report = [json.loads(l) for l in (run / "external" / "report.jsonl").read_text().splitlines()]
    assert [r["version"] for r in report] == list(range(1, steps + 1))
    assert all(r["logprob_agreement_max"] <= 1e-3 for r in report), report
    assert json.loads((run / "summary.json").read_text())["steps"] == steps


def test_an_external_trainer_that_never_answers(agent, tmp_path):
    """No weights within train.external_timeout_s: bragg-rl stops with an error that says what
    it waited for and where."""
    config = write_config(tmp_path, steps=2, calm=True,
                          train_extra="external = true\nexternal_timeout_s = 2\n")
    p = start(config, agent)
    rc = p.wait(timeout=300)
    log = log_tail(config)
    assert rc != 0, log
    assert "no weights for version 1" in log and "external/v000001" in log, log
    assert (tmp_path / "run" / "batches" / "step-000001.jsonl").exists()


def test_kill_9_then_resume_trains_nothing_twice(agent, tmp_path):
    config = write_config(tmp_path, steps=8, calm=True, checkpoint_every=2)
    run = tmp_path / "run"
    p = start(config, agent)
    wait_for_step(run, 5, p, config)
    # /metrics while it runs: the step lines up to the step it reports, summed.
    live = scrape(run)
    upto = [s for s in steps_of(run) if s["step"] <= live["bragg_rl_step"]]
    assert live["bragg_rl_step"] >= 5 and len(upto) == live["bragg_rl_step"], live
    assert live["bragg_rl_trajectories_trained_total"] == sum(s["samples"] for s in upto)
    assert live["bragg_rl_over_stale_total"] == 0
    assert live["bragg_rl_reward_mean"] == upto[-1]["reward_mean"]
    assert live["bragg_rl_version"] >= live["bragg_rl_step"]
    assert live["bragg_rl_tool_call_seconds_count"] >= sum(s["tool_calls"] for s in upto) > 0
    assert sum(v for k, v in live.items() if k.startswith("bragg_rl_trained_staleness_total{")) \
        == live["bragg_rl_trajectories_trained_total"]
    fleet = json.loads((run / "fleet.json").read_text())
    p.send_signal(signal.SIGKILL)
    p.wait()
    # Its engines and gateway die with it (parent-death signal), not orphaned.
    deadline = time.time() + 10
    while any(alive(s["pid"]) for s in fleet["servers"]) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(s["pid"]) for s in fleet["servers"])
    before = {t["step"]: t["ids"] for t in map(json.loads, (run / "trained.jsonl").read_text().splitlines())}
    assert max(before) >= 5
    p = start(config, agent, "--resume")
    finish(p, config)
    m = check_common(run, 1, 8)
    after = {t["step"]: t["ids"] for t in map(json.loads, (run / "trained.jsonl").read_text().splitlines())}
    # Steps up to the checkpoint (4) are kept as they were; the ones after it are redone on new
    # rollouts (new incarnation in their ids).
    for step in (1, 2, 3, 4):
        assert after[step] == before[step]
    old = {i.split("-")[0] for s in (1, 2, 3, 4) for i in before[s]}
    for step in range(5, 9):
        assert all(i.split("-")[0] not in old for i in after[step]), step
    events = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("event") == "start" and e.get("resume") for e in events)
    assert m[-1]["version"] == 8


def test_an_engine_killed_mid_run(agent, tmp_path):
    config = write_config(tmp_path, steps=8, calm=True)
    run = tmp_path / "run"
    p = start(config, agent)
    wait_for_step(run, 2, p, config)
    fleet = json.loads((run / "fleet.json").read_text())
    engine = next(s for s in fleet["servers"] if s["name"].startswith("engine"))
    os.kill(engine["pid"], signal.SIGKILL)
    finish(p, config)
    check_common(run, 1, 8)


def test_the_sandbox_agent_restarted_mid_run(agent, tmp_path):
    config = write_config(tmp_path, steps=8, calm=True)
    run = tmp_path / "run"
    p = start(config, agent)
    wait_for_step(run, 2, p, config)
    agent.kill()
    time.sleep(0.5)
    agent.start()
    finish(p, config)
    m = check_common(run, 1, 8)
    assert sum(s["sandbox_recoveries"] for s in m[-1:]) >= 1


@contextlib.contextmanager
def second_agent(tmp_path: Path):
    (tmp_path / "pbox2").mkdir()
    second = Agent(tmp_path / "pbox2")
    try:
        yield second
    finally:
        second.stop()


def start_on_two_agents(agent: Agent, second: Agent, tmp_path: Path, steps: int):
    """bragg-rl with fleet.pbox naming both agents, past its second step."""
    config = write_config(tmp_path, steps=steps, calm=True,
                          extra=f'pbox = "unix://{agent.sock},unix://{second.sock}"\n')
    run = tmp_path / "run"
    p = start(config, agent)
    wait_for_step(run, 2, p, config)
    return config, run, p


def test_sandboxes_on_two_agents_one_restarted(agent, tmp_path):
    """fleet.pbox naming two agents (a comma-separated list, as $PBOX_ENDPOINTS or pbox-slurm's
    endpoints file give them): groups are spread over both; one agent killed and restarted
    mid-run is prepared again while the other keeps serving, and the run finishes. (The run is
    long enough for the recovery's retries to find the agent back with steps to spare: a step
    takes about half a second here, the agent is back after one to two.)"""
    with second_agent(tmp_path) as second:
        config, run, p = start_on_two_agents(agent, second, tmp_path, 16)
        seen = steps_of(run)[-1]["sandboxes_by_agent"]
        assert len(seen) == 2 and all(v > 0 for v in seen.values()), seen
        second.kill()
        time.sleep(0.5)
        second.start()
        log = tmp_path / "bragg-rl.log"
        while "prepared again" not in log.read_text(errors="replace"):
            assert p.poll() is None, "the run ended before the agent was prepared again:\n" + \
                log_tail(config)
            time.sleep(0.1)
        finish(p, config)
        m = check_common(run, 1, 16)
        assert m[-1]["sandbox_recoveries"] >= 1, m[-1]
        after = m[-1]["sandboxes_by_agent"]
        assert all(after[k] > seen[k] for k in seen), (seen, after)


def test_an_agent_down_for_a_while_is_recovered_in_the_background(agent, tmp_path):
    """One of two agents killed and left down: the first group start that finds it gone hands it
    to a recovery that retries in the background, so the dead agent costs one failed start (not
    one every few seconds) while the other serves every group; started again, it is prepared
    again by that same recovery and serves too."""
    with second_agent(tmp_path) as second:
        config, run, p = start_on_two_agents(agent, second, tmp_path, 80)
        second.kill()
        at_kill = steps_of(run)[-1]
        down = time.time()
        wait_for_step(run, at_kill["step"] + 3, p, config, timeout=120)
        while time.time() - down < 8:
            assert p.poll() is None, log_tail(config)
            time.sleep(0.2)
        during = steps_of(run)[-1]
        first = next(k for k in at_kill["sandboxes_by_agent"] if str(agent.sock) in k)
        other = next(k for k in at_kill["sandboxes_by_agent"] if str(second.sock) in k)
        failed = [line for line in (tmp_path / "bragg-rl.log").read_text().splitlines()
                  if "cloning" in line and str(second.sock) in line]
        assert len(failed) == 1, failed
        assert during["sandbox_recoveries"] == 1, during
        assert during["sandboxes_by_agent"][first] > at_kill["sandboxes_by_agent"][first]
        second.start()
        deadline = time.time() + 60
        while steps_of(run)[-1]["sandboxes_by_agent"][other] <= during["sandboxes_by_agent"][other]:
            assert time.time() < deadline, \
                "the restarted agent got no sandboxes:\n" + log_tail(config)
            assert p.poll() is None, log_tail(config)
            time.sleep(0.2)
        finish(p, config)
        m = check_common(run, 1, 80)
        assert m[-1]["sandbox_recoveries"] == 1, m[-1]


def refused(config: Path, agent: Agent, needle: str) -> None:
    env = dict(os.environ, PBOX_ENDPOINT=f"unix://{agent.sock}")
    r = subprocess.run([str(RL), "run", str(config)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert not (config.parent / "run" / "fleet.json").exists(), "an engine was started"


def test_bad_input_is_refused_before_anything_starts(agent, tmp_path):
    # A key that does not exist.
    d = tmp_path / "a"
    d.mkdir()
    c = write_config(d, extra="[fleet.extra]\n")
    refused(c, agent, "fleet.extra")
    # A tool server that is not there.
    d = tmp_path / "b"
    d.mkdir()
    c = write_config(d)
    c.write_text(c.read_text().replace("/task/chaos_env.py\", \"serve", "/task/missing.py\", \"serve"))
    refused(c, agent, "task.tool_server")
    # A verifier that prints no number.
    d = tmp_path / "c"
    d.mkdir()
    c = write_config(d)
    c.write_text(c.read_text().replace(VERIFIER_LINE, 'verifier = ["echo", "maybe"]'))
    refused(c, agent, "task.verifier")
    # verifier_in_tool_server with a tool server that does not score: `cat` answers the verify
    # line with itself, a JSON object without a reward.
    d = tmp_path / "v"
    d.mkdir()
    c = write_config(d)
    text = c.read_text().replace(VERIFIER_LINE, "verifier_in_tool_server = true")
    c.write_text(text.replace('["python3", "/task/chaos_env.py", "serve"]', '["cat"]'))
    refused(c, agent, 'must answer {"verify": ROLLOUT} with {"reward": NUMBER}')
    # A prompt longer than the context.
    d = tmp_path / "e"
    d.mkdir()
    long_prompts = d / "long.jsonl"
    long_prompts.write_text(json.dumps({"prompt": "x" * 100 + "\n"}) + "\n")
    c = write_config(d)
    c.write_text(c.read_text().replace(str(CHAOS / "prompts.jsonl"), str(long_prompts)))
    refused(c, agent, "does not fit")
