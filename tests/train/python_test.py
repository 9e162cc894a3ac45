"""bragg_train from Python, as a user's training loop drives it: the same weights as the
bragg-train command, bit for bit, on the same trajectories and options; checkpoint and resume
bit for bit; hostile trajectories and options refused before anything is trained; a trainer shared
by threads, with the GIL released while it computes; two data-parallel ranks in two processes;
the trainer in its own process (the default) and in this one (in_process=True), a crash of its
process an error and not the caller's end, and either way beside PyPI's torch.

Run by ctest (train_python_test) with PYTHONPATH=<build>/python, BRAGG_TRAIN and
BRAGG_WRITE_TINY_MODEL set.
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time

import bragg_train

# The trainer in this process must compute with the kernels bragg-train picks for itself: OpenBLAS
# reads OPENBLAS_CORETYPE when first loaded, here by numpy, so it is set before that.
bragg_train.use_known_blas_core()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

TRAIN = os.environ.get("BRAGG_TRAIN", "bragg-train")
WRITE = os.environ.get("BRAGG_WRITE_TINY_MODEL", "write_tiny_model")
VOCAB = 64
# Deterministic arithmetic on one thread: results are bit for bit reproducible.
OPTS = dict(deterministic=True, lr=1e-2, threads=1)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def model_bytes(d):
    with open(os.path.join(d, "model.safetensors"), "rb") as f:
        return f.read()


@pytest.fixture(params=["own process", "in process"])
def mode(request):
    """Trainer keyword arguments: the trainer in its own process, or in this one."""
    return {"in_process": request.param == "in process"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("bragg-train-python")
    model = str(d / "model")
    subprocess.run([WRITE, model, "--vocab", str(VOCAB)], check=True)
    rng = random.Random(11)
    raw = []
    for i in range(16):
        n = rng.randint(12, 60)
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        raw.append({"id": f"r{i}", "group": f"g{i // 4}", "tokens": tokens, "loss_mask": mask,
                    "logprobs": [0.0] * n, "reward": float(rng.random() < 0.5)})
    # Behaviour log-probs: the model's own, from the command (what a rollout on it returned).
    out = subprocess.run([TRAIN, "logprobs", "--model", model, "--deterministic", "--trajectories",
                          write_jsonl(d / "raw.jsonl", raw)],
                         check=True, capture_output=True, text=True).stdout
    lps = {json.loads(l)["id"]: json.loads(l)["logprobs"] for l in out.splitlines()}
    for t in raw:
        t["logprobs"] = lps[t["id"]]
    return {"dir": d, "model": model, "raw": raw, "path": write_jsonl(d / "t.jsonl", raw)}


def batch_of(raw, s, bs=8):
    """bragg-train's batch for step s: file order, wrapping, ids suffixed with the step."""
    return [dict(raw[(s * bs + i) % len(raw)], id=f"{raw[(s * bs + i) % len(raw)]['id']}#{s}")
            for i in range(bs)]


def test_steps_equal_the_commands_bit_for_bit(data, mode, tmp_path):
    d = tmp_path
    subprocess.run([TRAIN, "--model", data["model"], "--trajectories", data["path"], "--steps",
                    "3", "--batch-size", "8", "--deterministic", "--lr", "1e-2", "--threads",
                    "1", "--out", str(d / "cli-out"), "--metrics", str(d / "cli.jsonl")],
                   check=True, capture_output=True)
    with open(d / "cli.jsonl") as f:
        cli = [json.loads(l) for l in f]

    trainer = bragg_train.Trainer(data["model"], **OPTS, **mode)
    # Half the batches as numpy arrays, half as lists: the same numbers either way.
    py = []
    for s in range(3):
        batch = batch_of(data["raw"], s)
        if s % 2:
            batch = [dict(t, tokens=np.asarray(t["tokens"], dtype=np.int64),
                          loss_mask=np.asarray(t["loss_mask"], dtype=np.uint8),
                          logprobs=np.asarray(t["logprobs"], dtype=np.float32)) for t in batch]
        py.append(trainer.step(batch))
    trainer.save_model(d / "py-out")

    assert model_bytes(d / "py-out") == model_bytes(d / "cli-out")
    assert [set(m) for m in py] == [set(m) for m in cli]
    timing = {"seconds", "tokens_per_second", "rank_seconds_max", "rank_seconds_mean"}
    for a, b in zip(py, cli):
        assert {k: v for k, v in a.items() if k not in timing} == \
               {k: v for k, v in b.items() if k not in timing}
    assert [m["version"] for m in py] == [1, 2, 3]
    assert trainer.steps == 3 and trainer.version == 3
    # Training moved the policy: the log-probs are no longer the behaviour's.
    assert py[-1]["logprob_diff_max"] > 0
    assert py[0]["logprob_diff_max"] == 0.0


def test_logprobs_equal_the_commands(data, mode):
    trainer = bragg_train.Trainer(data["model"], **OPTS, **mode)
    mine = trainer.logprobs(data["raw"])
    assert len(mine) == len(data["raw"])
    for t, lp in zip(data["raw"], mine):
        assert lp.dtype == np.float32 and lp.shape == (len(t["tokens"]),)
        assert lp[0] == 0.0
        np.testing.assert_array_equal(lp, np.asarray(t["logprobs"], dtype=np.float32))


def test_read_trajectories_round_trips_the_file(data):
    got = bragg_train.read_trajectories(data["path"])
    assert [t["id"] for t in got] == [t["id"] for t in data["raw"]]
    for a, b in zip(got, data["raw"]):
        assert a["tokens"].tolist() == b["tokens"] and a["loss_mask"].tolist() == b["loss_mask"]
        assert a["reward"] == b["reward"] and a["group"] == b["group"]
    # What it returns is a batch as it stands.
    trainer = bragg_train.Trainer(data["model"], **OPTS)
    assert trainer.step(got[:4])["trajectories"] == 4
    with pytest.raises(FileNotFoundError):
        bragg_train.read_trajectories(str(data["dir"] / "no-such.jsonl"))


def test_group_advantages(data):
    batch = [{"id": "a", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1],
              "logprobs": [0, 0], "reward": 1.0},
             {"id": "b", "group": "g", "tokens": [1, 2], "loss_mask": [0, 1],
              "logprobs": [0, 0], "reward": 0.0},
             {"id": "c", "group": "h", "tokens": [1, 2], "loss_mask": [0, 1],
              "logprobs": [0, 0], "reward": 0.0, "advantage": 0.25}]
    adv = bragg_train.group_advantages(batch, normalize_std=False)
    assert adv.tolist() == [0.5, -0.5, 0.25]
    adv = bragg_train.group_advantages(batch)  # the sample std: 0.5 / sqrt(0.5)
    assert adv[0] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5) and adv[0] == -adv[1]


def test_checkpoint_and_resume_bit_for_bit(data):
    d = data["dir"]
    whole = bragg_train.Trainer(data["model"], **OPTS)
    for s in range(4):
        whole.step(batch_of(data["raw"], s))
    whole.save_model(d / "whole")

    first = bragg_train.Trainer(data["model"], **OPTS)
    for s in range(2):
        first.step(batch_of(data["raw"], s))
    first.save_checkpoint(d / "ckpt")
    del first
    again = bragg_train.Trainer.resume(d / "ckpt", **OPTS)
    assert again.steps == 2 and again.version == 2
    for s in range(2, 4):
        again.step(batch_of(data["raw"], s))
    again.save_model(d / "resumed")
    assert model_bytes(d / "resumed") == model_bytes(d / "whole")
    with pytest.raises((FileNotFoundError, ValueError)):
        bragg_train.Trainer.resume(d / "no-checkpoint", **OPTS)


def test_router_replay_takes_the_routing_it_returned(data):
    trainer = bragg_train.Trainer(data["model"], **OPTS)
    batch = batch_of(data["raw"], 0)
    routed = trainer.routed_experts(batch)
    with open(os.path.join(data["model"], "config.json")) as f:
        top_k = json.load(f)["num_experts_per_tok"]
    for t, r in zip(batch, routed):
        assert r.dtype == np.int32 and r.size % ((len(t["tokens"]) - 1) * top_k) == 0
        assert r.size > 0
    # Given back shaped [tokens - 1, layers, top_k], as an engine's meta_info would be.
    replay = [dict(t, routed_experts=r.reshape(len(t["tokens"]) - 1, -1, top_k))
              for t, r in zip(batch, routed)]
    assert trainer.logprobs(replay)[0].tolist() == trainer.logprobs(batch)[0].tolist()
    assert trainer.step(replay)["trajectories"] == len(batch)


def good():
    return {"id": "ok", "group": "g", "tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1],
            "logprobs": [0.0, 0.0, -1.0, -1.0], "reward": 1.0}


HOSTILE = [
    ("float tokens", dict(good(), tokens=[1, 2, 3.5, 4]), ValueError, "tokens"),
    ("string tokens", dict(good(), tokens="abcd"), ValueError, "tokens"),
    ("object tokens", dict(good(), tokens=[object()] * 4), ValueError, "tokens"),
    ("2-D tokens", dict(good(), tokens=[[1, 2], [3, 4]]), ValueError, "tokens"),
    ("token past int32", dict(good(), tokens=[1, 2, 2**40, 4]), ValueError, "out of range"),
    ("token past uint64 int64", dict(good(), tokens=np.array([1, 2, 2**63, 4], dtype=np.uint64)),
     ValueError, "out of range"),
    ("token out of vocabulary", dict(good(), tokens=[1, 2, VOCAB, 4]), ValueError, "ok"),
    ("negative token", dict(good(), tokens=[1, 2, -1, 4]), ValueError, "ok"),
    ("short mask", dict(good(), loss_mask=[0, 1, 1]), ValueError, "ok"),
    ("mask of 2", dict(good(), loss_mask=[0, 0, 2, 1]), ValueError, "loss_mask"),
    ("no loss token", dict(good(), loss_mask=[0, 0, 0, 0]), ValueError, "ok"),
    ("long logprobs", dict(good(), logprobs=[0.0] * 5), ValueError, "ok"),
    ("NaN logprob", dict(good(), logprobs=[0, 0, math.nan, 0]), ValueError, "ok"),
    ("NaN reward", dict(good(), reward=math.nan), ValueError, "ok"),
    ("string reward", dict(good(), reward="1"), ValueError, "reward"),
    ("bool reward", dict(good(), reward=True), ValueError, "reward"),
    ("unknown field", dict(good(), rewards=1.0), ValueError, "rewards"),
    ("no tokens", {k: v for k, v in good().items() if k != "tokens"}, ValueError, "tokens"),
    ("no logprobs", {k: v for k, v in good().items() if k != "logprobs"}, ValueError,
     "logprobs"),
    ("no reward", {k: v for k, v in good().items() if k != "reward"}, ValueError, "reward"),
    ("a list, not a dict", [1, 2, 3], TypeError, "not a dict"),
]


@pytest.mark.parametrize("name,bad,error,words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_trajectory_is_refused_and_nothing_is_trained(data, mode, name, bad, error,
                                                              words):
    trainer = bragg_train.Trainer(data["model"], **OPTS, **mode)
    before = trainer.logprobs([good()])[0]
    batch = batch_of(data["raw"], 0)[:3] + [bad]
    with pytest.raises(error) as e:
        trainer.step(batch)
    assert words in str(e.value), str(e.value)
    assert trainer.steps == 0 and trainer.version == 0
    np.testing.assert_array_equal(trainer.logprobs([good()])[0], before)


def test_hostile_batches_and_options(data, mode):
    trainer = bragg_train.Trainer(data["model"], **OPTS, **mode)
    with pytest.raises(TypeError, match="sequence"):
        trainer.step(good())
    with pytest.raises(TypeError):
        trainer.step(42)
    with pytest.raises(ValueError):
        trainer.step([])
    with pytest.raises(ValueError, match="ok"):  # the same id twice in one batch
        trainer.step([good(), good()])
    assert trainer.steps == 0
    with pytest.raises(TypeError, match="lrr"):
        bragg_train.Trainer(data["model"], lrr=1e-3, **mode)
    with pytest.raises(TypeError, match="lr"):
        bragg_train.Trainer(data["model"], lr="fast", **mode)
    with pytest.raises(ValueError, match="ppo"):
        bragg_train.Trainer(data["model"], objective="ppo", **mode)
    with pytest.raises(ValueError, match="partial"):
        bragg_train.Trainer(data["model"], recompute="partial", **mode)
    with pytest.raises(ValueError, match="fastest"):
        bragg_train.Trainer(data["model"], dp_balance="fastest", **mode)
    with pytest.raises((ValueError, FileNotFoundError), match="no-such-model"):
        bragg_train.Trainer(data["dir"] / "no-such-model", **mode)
    with pytest.raises(ValueError):
        trainer.set_lr(math.nan)
    with pytest.raises(ValueError):
        trainer.version = -1
    defaults = bragg_train.options_defaults()
    assert defaults["lr"] == 1e-4 and defaults["objective"] == "grpo"
    assert defaults["dp_balance"] == "cost" and defaults["recompute"] == "none"
    assert trainer.options["deterministic"] is True and trainer.options["threads"] == 1


def test_threads_share_a_trainer_and_the_gil_is_released(data, mode):
    trainer = bragg_train.Trainer(data["model"], deterministic=True, threads=1, **mode)
    batches = [batch_of(data["raw"], s) for s in range(4)]
    results, errors = [], []
    ticks = [0]
    done = threading.Event()

    def ticker():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    def worker(b):
        try:
            results.append(trainer.step(b))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    t0 = threading.Thread(target=ticker)
    t0.start()
    workers = [threading.Thread(target=worker, args=(b,)) for b in batches]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    t0.join()
    assert errors == []
    assert sorted(m["step"] for m in results) == [1, 2, 3, 4]
    assert trainer.steps == 4
    # Python ran while the steps computed (with the GIL held it could not tick between them).
    seconds = sum(m["seconds"] for m in results)
    assert ticks[0] >= min(20, int(seconds * 200)), (ticks[0], seconds)


RANK = """
import json, sys, bragg_train
raw = [json.loads(l) for l in open(sys.argv[3])]
t = bragg_train.Trainer(sys.argv[1], deterministic=True, lr=1e-2, threads=1, world_size=2,
                        rank=int(sys.argv[2]), rendezvous="file:" + sys.argv[4])
ms = [t.step(raw[s * 8:(s + 1) * 8]) for s in range(2)]
lp = t.logprobs(raw[:4])
print(json.dumps({"metrics": ms, "logprobs": [x.tolist() for x in lp]}))
"""


def test_two_data_parallel_ranks_hold_the_same_weights(data):
    rdv = data["dir"] / "rendezvous"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, data["model"], str(r), data["path"],
                               str(rdv)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    # The gradients were summed over the ranks: both end with the same policy.
    assert outs[0]["logprobs"] == outs[1]["logprobs"]
    assert outs[0]["logprobs"] != [t["logprobs"] for t in data["raw"][:4]]
    for m0, m1 in zip(outs[0]["metrics"], outs[1]["metrics"]):
        assert m0["version"] == m1["version"] and m0["loss"] == m1["loss"]


def test_a_crash_of_the_trainers_process_is_an_error_here(data):
    trainer = bragg_train.Trainer(data["model"], **OPTS)
    trainer.step(batch_of(data["raw"], 0))
    os.kill(trainer._b._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="signal 9"):
        trainer.step(batch_of(data["raw"], 1))
    with pytest.raises(RuntimeError, match="signal 9"):  # and stays so
        _ = trainer.steps
    # This process goes on, and a new trainer works.
    with bragg_train.Trainer(data["model"], **OPTS) as again:
        assert again.step(batch_of(data["raw"], 0))["version"] == 1
        proc = again._b._proc
    assert proc.wait(timeout=30) == 0  # closed: its process ended by itself
    with pytest.raises(RuntimeError, match="closed"):
        again.step(batch_of(data["raw"], 0))


ONE_PROCESS = """
import os, sys, bragg_train
t = bragg_train.Trainer(sys.argv[1], deterministic=True, threads=1, lr=1e-2)
with open("/proc/%d/task/%d/children" % (os.getpid(), os.getpid())) as f:
    kids = f.read().split()
assert len(kids) == 1, kids                  # the trainer's process, and no helper beside it
assert "bragg_train._core" not in sys.modules  # nor the extension in this one
t.close()
print("ok")
"""


def test_a_trainer_is_one_child_process_and_nothing_here(data):
    out = subprocess.run([sys.executable, "-c", ONE_PROCESS, data["model"]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok"]


PEER_PYTHON = os.environ.get("BRAGG_PEER_PYTHON", "/var/cache/bragg/pyenv/bin/python")
BESIDE_TORCH = """
import sys, bragg_train
order, model, path, site = sys.argv[1:5]
assert bragg_train.__file__.startswith(site), bragg_train.__file__

def torch_works():
    import torch
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]
    return torch.__version__

if order == "torch first":
    version = torch_works()
raw = bragg_train.read_trajectories(path)
with bragg_train.Trainer(model, deterministic=True, lr=1e-2, threads=1) as t:
    m = t.step(raw[:8])
    if order == "torch after":
        version = torch_works()
# In process: refused beside torch, and torch refused beside it, with messages, not crashes.
if order == "torch first":
    try:
        bragg_train.Trainer(model, in_process=True)
        raise SystemExit("in_process=True was not refused beside torch")
    except ImportError as e:
        assert "already loaded" in str(e), e
print(version, m["version"])
"""
LATE_CORETYPE = """
import os, sys
import bragg_train._core as c  # loads the trainer's OpenBLAS before the variable below is set
os.environ["OPENBLAS_CORETYPE"] = sys.argv[2]
import bragg_train
t = bragg_train.Trainer(sys.argv[1], deterministic=True, threads=1, in_process=True)
print(repr(c.known_blas_core()), repr(c.blas_fallback_core()))
"""


def test_an_openblas_core_type_set_too_late_is_named(data):
    """OpenBLAS reads OPENBLAS_CORETYPE once, when a process loads it: a program that loaded the
    trainer's OpenBLAS before setting it still runs the fallback kernels, and the trainer says
    so. On a CPU
    this OpenBLAS knows there is no fallback and nothing to say."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    clean = subprocess.run(
        [sys.executable, "-c", "import bragg_train._core as c; print(c.known_blas_core())"],
        env=env, capture_output=True, text=True, timeout=300, check=True).stdout.strip()
    wanted = clean or "Haswell"
    out = subprocess.run([sys.executable, "-c", LATE_CORETYPE, data["model"], wanted], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # The variable is set, so nothing would restart; the fallback is still found.
    assert out.stdout.split() == ["''", repr(clean)], out.stdout
    late = f"although OPENBLAS_CORETYPE={wanted}: the variable was set after"
    assert (late in out.stderr) == bool(clean), out.stderr[-3000:]


IN_PROCESS_THEN_TORCH = """
import sys, bragg_train
t = bragg_train.Trainer(sys.argv[1], deterministic=True, threads=1, in_process=True)
try:
    import torch
    raise SystemExit("import torch was not refused")
except ImportError as e:
    assert "in_process=True" in str(e), e
print(t.steps)
"""


@pytest.fixture
def peer(tmp_path):
    """The peer environment's Python (PyPI torch) with only this package added to its path."""
    if not os.access(PEER_PYTHON, os.X_OK):
        pytest.skip(f"no Python peer environment at {PEER_PYTHON} (scripts/install-deps)")
    site = tmp_path / "site"
    site.mkdir()
    os.symlink(os.path.dirname(os.path.abspath(bragg_train.__file__)), site / "bragg_train")

    def run(script, *args):
        env = dict(os.environ, PYTHONPATH=str(site))
        # A build tree's extension is made for Debian's Python and its NumPy 1 (pybind11 2.10
        # reads NumPy 2's arrays wrongly): its process runs that Python. An installed one is made
        # for the Python it was installed into, which is the caller's.
        if os.environ.get("BRAGG_PYTHON"):
            env["BRAGG_TRAIN_PYTHON"] = os.environ["BRAGG_PYTHON"]
        out = subprocess.run([PEER_PYTHON, "-c", script, *map(str, args)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout, str(site)
    return run


@pytest.mark.parametrize("order", ["torch first", "torch after"])
def test_trains_beside_pypi_torch(data, peer, order):
    """A Megatron or transformers user's process already holds PyPI's torch, another libtorch
    than the trainer's: the trainer (in its own process) trains there, and torch still works."""
    out, _ = peer(BESIDE_TORCH, order, data["model"], data["path"], "")
    version, trained = out.split()
    assert not version.startswith("1.13") and trained == "1"


def test_in_process_trainer_refuses_a_later_torch_import(data, peer):
    out, _ = peer(IN_PROCESS_THEN_TORCH, data["model"])
    assert out.split() == ["0"]
