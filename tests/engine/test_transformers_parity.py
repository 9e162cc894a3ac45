"""bragg-engine against Hugging Face transformers on tiny random Qwen3 and Qwen3-MoE checkpoints
(make_models.py), through the engine's real binaries:

  bragg-engine-score ($BRAGG_ENGINE_SCORE)
      --model DIR --ids IDS_JSON --logits OUT_F32 [--dtype float32|bfloat16]
          writes little-endian float32 [len(ids), vocab]; prints {"tokens": n, "vocab": v}
      --model DIR --ids IDS_JSON --greedy N [--dtype ...]
          prints {"output_ids": [...]}: N greedy tokens through the scheduler (KV cache, decode)
  bragg-engine ($BRAGG_ENGINE) --model DIR --listen 127.0.0.1:0
      first stdout line "listening on http://HOST:PORT"; SGLang's POST /generate

What must hold:
  float32   full-sequence logits over sequences of 1, 7, 64 and 300 tokens, against the same
            weights computed in float64: the engine's max and RMS error at most 2x
            transformers' own (which is ~1e-4 max, ~1e-5 RMS on these logits of std 4: a fixed
            bound on |engine - transformers| would only measure two roundings); greedy: the
            same 256 tokens for each prompt (the references have no top-2 gap under 2e-3, so
            rounding cannot excuse a change).
  bfloat16  bf16 rounding through 4 layers moves transformers' own logits by up to ~1.5 (RMS
            ~0.2, logits std 8) from the same weights computed in float32, so a fixed absolute
            bound says little. The engine must be as accurate as transformers: its max and RMS
            error against that float32 computation at most 2x transformers'. Greedy (32 tokens):
            wherever transformers' top-2 gap is at least BF16_DECIDED, the engine picks the same
            token given the same prefix (teacher-forced), and its own greedy run matches
            transformers' up to the first step whose gap is smaller.
  server    /generate greedy (temperature 0, ignore_eos) returns transformers' first 64 tokens,
            and output_token_logprobs within 1e-4 of transformers' log-softmax.
"""

import json
import os
import select
import subprocess
import time
import urllib.request

import numpy as np
import pytest

import make_models

SCORE = os.environ.get("BRAGG_ENGINE_SCORE")
SERVER = os.environ.get("BRAGG_ENGINE")
FP32 = [n for n, s in make_models.SHAPES.items() if s[3] == "float32"]
BF16 = [n for n, s in make_models.SHAPES.items() if s[3] == "bfloat16"]
LOGPROB_ATOL = 1e-4
BF16_DECIDED = 1.0
SERVER_TOKENS = 64

needs_score = pytest.mark.skipif(not SCORE, reason="BRAGG_ENGINE_SCORE not set (bragg-engine-score "
                                 "not built)")
needs_server = pytest.mark.skipif(not SERVER, reason="BRAGG_ENGINE not set (bragg-engine not built)")


def reference(model_dir):
    with open(os.path.join(model_dir, "reference", "greedy.json")) as f:
        return json.load(f)


def ref_ids(model_dir, n):
    with open(os.path.join(model_dir, "reference", f"ids_L{n}.json")) as f:
        return json.load(f)


def run_score(args):
    p = subprocess.run([SCORE] + args, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"bragg-engine-score {' '.join(args)}: exit {p.returncode}\n{p.stderr}"
    lines = [line for line in p.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"want one JSON line on stdout, got {p.stdout!r}"
    return json.loads(lines[0])


def write_ids(tmp_path, ids):
    path = tmp_path / f"ids-{len(ids)}-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(ids))
    return str(path)


def engine_logits(model_dir, ids, dtype, tmp_path):
    out = tmp_path / f"logits-{len(ids)}.f32"
    reply = run_score(["--model", model_dir, "--ids", write_ids(tmp_path, ids), "--logits",
                       str(out), "--dtype", dtype])
    vocab = reference(model_dir)["vocab"]
    assert reply == {"tokens": len(ids), "vocab": vocab}
    raw = out.read_bytes()
    assert len(raw) == len(ids) * vocab * 4, f"{len(raw)} bytes for [{len(ids)}, {vocab}] float32"
    return np.frombuffer(raw, dtype="<f4").reshape(len(ids), vocab)


def engine_greedy(model_dir, prompt, n, dtype, tmp_path):
    reply = run_score(["--model", model_dir, "--ids", write_ids(tmp_path, prompt), "--greedy",
                       str(n), "--dtype", dtype])
    assert list(reply) == ["output_ids"]
    return reply["output_ids"]


def first_divergence(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def describe_divergence(got, want, gaps):
    i = first_divergence(got, want)
    engine_token = got[i] if i < len(got) else "(none)"
    return (f"greedy diverges at step {i} of {len(want)}: engine {engine_token}, transformers "
            f"{want[i]} (transformers' top-2 logit gap there {gaps[i]:.3g}); "
            f"engine {got[max(0, i - 3):i + 4]}, transformers {want[max(0, i - 3):i + 4]}")


# ---- float32: bragg-engine-score -------------------------------------------------------------

@needs_score
@pytest.mark.parametrize("n", make_models.SEQ_LENGTHS)
@pytest.mark.parametrize("name", FP32)
def test_fp32_logits_as_accurate_as_transformers(models, name, n, tmp_path):
    ref_dir = os.path.join(models[name], "reference")
    exact = np.load(os.path.join(ref_dir, f"logits_exact_L{n}.npy"))
    assert exact.dtype == np.float64
    hf = np.load(os.path.join(ref_dir, f"logits_L{n}.npy")).astype(np.float64)
    got = engine_logits(models[name], ref_ids(models[name], n), "float32", tmp_path)
    assert np.isfinite(got).all()
    got = got.astype(np.float64)
    hf_err, err = np.abs(hf - exact), np.abs(got - exact)
    rms = lambda e: float(np.sqrt((e ** 2).mean()))  # noqa: E731
    pos, tok = np.unravel_index(err.argmax(), err.shape)
    where = (f"worst at position {pos}, token {tok}: engine {got[pos, tok]:.7f}, transformers "
             f"{hf[pos, tok]:.7f}, float64 {exact[pos, tok]:.7f}; max |engine - transformers| "
             f"{np.abs(got - hf).max():.3g}")
    # floors for short sequences, where transformers may round almost nothing
    assert err.max() <= 2 * hf_err.max() + 1e-5, (
        f"{name}, {n} tokens: engine float32 max error {err.max():.3g} vs transformers' "
        f"{hf_err.max():.3g} (both against float64); {where}")
    assert rms(err) <= 2 * rms(hf_err) + 1e-6, (
        f"{name}, {n} tokens: engine float32 RMS error {rms(err):.3g} vs transformers' "
        f"{rms(hf_err):.3g}; {where}")


@needs_score
@pytest.mark.parametrize("name", FP32)
def test_fp32_greedy_matches_transformers(models, name, tmp_path):
    for run in reference(models[name])["greedy"]:
        got = engine_greedy(models[name], run["prompt"], len(run["output_ids"]), "float32",
                            tmp_path)
        assert got == run["output_ids"], describe_divergence(got, run["output_ids"], run["gaps"])


@needs_score
def test_score_refuses_ids_outside_the_vocabulary(models, tmp_path):
    model = models["dense"]
    for bad in ([0, 512, 3], [-1]):
        p = subprocess.run([SCORE, "--model", model, "--ids", write_ids(tmp_path, bad), "--logits",
                            str(tmp_path / "x.f32")], capture_output=True, text=True, timeout=120)
        assert p.returncode != 0, f"ids {bad} accepted"
        assert p.stderr.strip(), "an error must say what went wrong"


@needs_score
def test_score_refuses_a_directory_without_a_model(tmp_path):
    p = subprocess.run([SCORE, "--model", str(tmp_path), "--ids", write_ids(tmp_path, [1, 2]),
                        "--logits", str(tmp_path / "x.f32")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0
    assert p.stderr.strip()


# ---- bfloat16 ------------------------------------------------------------------------------

@needs_score
@pytest.mark.parametrize("n", make_models.SEQ_LENGTHS)
@pytest.mark.parametrize("name", BF16)
def test_bf16_logits_as_accurate_as_transformers(models, name, n, tmp_path):
    ref_dir = os.path.join(models[name], "reference")
    exact = np.load(os.path.join(ref_dir, f"logits_exact_L{n}.npy")).astype(np.float64)
    hf = np.load(os.path.join(ref_dir, f"logits_L{n}.npy"))
    got = engine_logits(models[name], ref_ids(models[name], n), "bfloat16", tmp_path)
    assert np.isfinite(got).all()
    hf_err, err = np.abs(hf - exact), np.abs(got - exact)
    rms = lambda e: float(np.sqrt((e ** 2).mean()))  # noqa: E731
    # a floor for the 1-token case, where transformers may round almost nothing
    assert err.max() <= 2 * hf_err.max() + 0.05, (
        f"{name}, {n} tokens: engine bf16 max error {err.max():.3g} vs transformers' "
        f"{hf_err.max():.3g} (both against the same weights in float32)")
    assert rms(err) <= 2 * rms(hf_err) + 0.01, (
        f"{name}, {n} tokens: engine bf16 RMS error {rms(err):.3g} vs transformers' "
        f"{rms(hf_err):.3g}")


@needs_score
@pytest.mark.parametrize("name", BF16)
def test_bf16_greedy_matches_transformers_where_decided(models, name, tmp_path):
    decided_steps = 0
    for run in reference(models[name])["greedy"]:
        prompt, want, gaps = run["prompt"], run["output_ids"], run["gaps"]
        # teacher-forced: the engine's choice after transformers' prefix, at every decided step
        logits = engine_logits(models[name], prompt + want, "bfloat16", tmp_path)
        picks = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        for i, (pick, token, gap) in enumerate(zip(picks, want, gaps)):
            if gap >= BF16_DECIDED:
                decided_steps += 1
                assert pick == token, (
                    f"{name}: after transformers' prefix, step {i}: engine picks {pick}, "
                    f"transformers {token} with a top-2 gap of {gap:.3g}")
        # free-running: the same tokens up to the first step transformers could not decide
        got = engine_greedy(models[name], prompt, len(want), "bfloat16", tmp_path)
        assert len(got) == len(want)
        undecided = next((i for i, g in enumerate(gaps) if g < BF16_DECIDED), len(want))
        assert got[:undecided] == want[:undecided], describe_divergence(got, want, gaps)
    assert decided_steps >= 16, "too few decided steps for the check to mean anything"


# ---- the server: SGLang's /generate ----------------------------------------------------------

class Server:
    def __init__(self, model_dir):
        self.proc = subprocess.Popen([SERVER, "--model", model_dir, "--listen", "127.0.0.1:0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("listening on "):
            self.close()
            raise AssertionError(f"bragg-engine did not start: {line!r} "
                                 f"{self.proc.stderr.read()[-2000:]!r}")
        self.url = line.split()[-1].rstrip("/")

    def post(self, path, body):
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def close(self):
        self.proc.kill()
        self.proc.wait()


@needs_server
@pytest.mark.parametrize("name", FP32)
def test_server_generate_matches_transformers(models, name):
    server = Server(models[name])
    try:
        for run in reference(models[name])["greedy"]:
            want = run["output_ids"][:SERVER_TOKENS]
            reply = server.post("/generate", {
                "input_ids": run["prompt"],
                "sampling_params": {"temperature": 0, "max_new_tokens": SERVER_TOKENS,
                                    "ignore_eos": True},
                "return_logprob": True})
            got = reply["output_ids"]
            assert got == want, describe_divergence(got, want, run["gaps"])
            entries = reply["meta_info"]["output_token_logprobs"]
            assert len(entries) == SERVER_TOKENS
            assert [e[1] for e in entries] == want
            lp = np.array([e[0] for e in entries], dtype=np.float64)
            err = np.abs(lp - np.array(run["logprobs"][:SERVER_TOKENS]))
            assert err.max() <= LOGPROB_ATOL, (
                f"{name}: output_token_logprobs off by {err.max():.3g} at step {err.argmax()}")
            assert reply["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        server.close()
