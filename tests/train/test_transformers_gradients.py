"""bragg-train's gradients against Hugging Face transformers' on the same checkpoints (built and
written by transformers' save_pretrained, in the shapes of tests/engine/make_models.py): the
supervised objective's gradient
for every parameter, dense, MoE and tied-embedding models, in both of bragg-train's attention paths
(--deterministic: the engine's exact kernel with its own backward; default: torch autograd).

Run by ctest (train_transformers_gradients_test) under the Python peer environment.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine"))
import make_models  # noqa: E402  (tests/engine: tiny checkpoints written by transformers)

TRAIN = os.environ.get("BRAGG_TRAIN", "bragg-train")
SHAPES = ["dense", "moe", "gqa4_tied"]
TOLERANCE = 1e-4  # max |ours - transformers'| / max |transformers'|, per tensor (FP32)


def trajectories(vocab, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate((9, 23, 40, 64, 77)):
        tokens = rng.integers(0, vocab, n).tolist()
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        out.append({"id": f"t{i}", "tokens": tokens, "loss_mask": mask,
                    "logprobs": [0.0] * n, "reward": 0.0})
    return out


def reference_gradients(model_dir, trajs):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    total = sum(sum(t["loss_mask"][1:]) for t in trajs)
    loss = 0
    for t in trajs:
        ids = torch.tensor([t["tokens"]])
        logits = model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(t["loss_mask"][1:], dtype=torch.float32)
        loss = loss - (logp * mask).sum()
    (loss / total).backward()
    return {n: p.grad.detach().numpy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("train-models")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    dirs = {}
    for name in SHAPES:
        arch, overrides, seed, _ = make_models.SHAPES[name]
        model = make_models.build(arch, overrides, seed)
        dirs[name] = os.path.join(str(out), name)
        model.save_pretrained(dirs[name], safe_serialization=True)
    return dirs


@pytest.mark.parametrize("deterministic", [False, True], ids=["autograd", "exact"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_equal_transformers(models, shape, deterministic, tmp_path):
    model_dir = models[shape]
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    trajs = trajectories(vocab, seed=SHAPES.index(shape))
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in trajs))
    out = tmp_path / "grads.safetensors"
    cmd = [TRAIN, "gradients", "--model", model_dir, "--trajectories", str(path),
           "--output", str(out), "--objective", "sft", "--threads", "2",
           "--max-tokens", "128"]  # several micro-batches of packed traces
    if deterministic:
        cmd.append("--deterministic")
    subprocess.run(cmd, check=True)
    ours = load_file(str(out))
    ref = reference_gradients(model_dir, trajs)
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    worst = 0.0
    for name, r in ref.items():
        scale = float(np.abs(r).max())
        assert scale > 0, name  # every parameter takes part
        err = float(np.abs(ours[name] - r).max()) / scale
        worst = max(worst, err)
        assert err < TOLERANCE, f"{name}: relative error {err:.3g}"
    print(f"{shape} {'exact' if deterministic else 'autograd'}: worst relative error {worst:.3g}")
