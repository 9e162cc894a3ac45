"""bragg-reshard end to end: Megatron-shaped torch_dist checkpoints written by real gloo processes
through PyTorch's distributed checkpoint writer, converted by bragg-reshard, compared bit for bit
with a torch reference converter."""

import filecmp
import json
import os
import struct
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

BIN = os.environ.get("BRAGG_RESHARD")
if not BIN or not os.path.exists(BIN):
    pytest.skip("BRAGG_RESHARD (the bragg-reshard binary) not set", allow_module_level=True)
try:
    import megatron_fixture  # installs the torch 1.13 import fix, then imports torch
    import torch
    import torch.distributed
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        raise ImportError("torch.distributed with gloo is not available")
except ImportError as e:  # noqa: F841
    pytest.skip(f"Debian's python3-torch is needed for the fixtures: {e}", allow_module_level=True)

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3-qproj"]
LEGACY_FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("reshard"))
    subprocess.run([sys.executable, megatron_fixture.__file__, "all", "--root", d], check=True,
                   timeout=300)
    return d


def run(*args, check=True):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"bragg-reshard {' '.join(args)} failed: {p.stderr}")
    return p


def convert(root, name, dst, *extra, check=True):
    family = name.split("-")[0]
    return run("convert", "--src", os.path.join(root, name), "--dst", dst, "--model", family,
               "--hf-config-dir", os.path.join(root, name + "-hf-config"), *extra, check=check)


DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        end = max(end, e)
        t = torch.frombuffer(bytearray(data[base + b:base + e]), dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"])
    assert base + end == len(data), "safetensors file has trailing or missing bytes"
    return out


def read_output(dst):
    with open(os.path.join(dst, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        part = read_safetensors(os.path.join(dst, shard))
        for name in part:
            assert index["weight_map"][name] == shard
        tensors.update(part)
    assert set(tensors) == set(index["weight_map"])
    return tensors, index


def assert_bit_identical(got, want):
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), name
        bits = {2: torch.int16, 4: torch.int32}[w.element_size()]
        assert torch.equal(g.view(bits), w.view(bits)), f"{name} differs"


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference_bit_for_bit(root, tmp_path, family):
    dst = str(tmp_path / "out")
    convert(root, family, dst, "--threads", "2", "--max-shard-size", "30K", "--verify")
    got, index = read_output(dst)
    assert len(set(index["weight_map"].values())) > 1, "expected several shards"
    assert_bit_identical(got, torch.load(os.path.join(root, family + "-ref.pt")))
    # Vocabulary padding trimmed.
    assert got["model.embed_tokens.weight"].shape[0] == 50
    assert os.path.exists(os.path.join(dst, "tokenizer_config.json"))
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["hidden_size"] == 32
    assert not [f for f in os.listdir(dst) if ".tmp" in f]


def test_newer_pytorch_class_paths(root, tmp_path):
    dst = str(tmp_path / "out")
    convert(root, "llama-newpaths", dst)
    got, _ = read_output(dst)
    assert_bit_identical(got, torch.load(os.path.join(root, "llama-ref.pt")))


def test_optimizer_state_is_skipped(root, tmp_path):
    # The llama fixture carries Adam's moments and fp32 master weights of every parameter and
    # Megatron's rng_state objects; they are listed, not converted, and the model converts bit
    # for bit (test_matches_reference_bit_for_bit[llama]).
    p = run("inspect", os.path.join(root, "llama"))
    assert ("optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc1.weight F32 [4,96,32] "
            "8 chunks (non-model state, skipped)") in p.stdout, p.stdout
    assert "rng_state/shard_0.0_2.2 bytes-item" in p.stdout
    assert ", 27 non-model tensors skipped" in p.stdout
    dst = str(tmp_path / "out")
    p = convert(root, "llama", dst)
    assert "skipping 27 tensors of non-model state" in p.stderr, p.stderr
    got, _ = read_output(dst)
    assert not [n for n in got if "optimizer" in n or "exp_avg" in n]
    assert_bit_identical(got, torch.load(os.path.join(root, "llama-ref.pt")))


def test_transform_descriptors_refused(root, tmp_path):
    p = convert(root, "llama-transforms", str(tmp_path / "out"), check=False)
    assert p.returncode != 0
    assert "transform_descriptors" in p.stderr


def test_identical_bytes_for_any_threads_and_ranks(root, tmp_path):
    one = str(tmp_path / "one")
    convert(root, "qwen2", one, "--threads", "1", "--max-shard-size", "20K")
    many = str(tmp_path / "many")
    world = 3
    for rank in range(world):
        p = convert(root, "qwen2", many, "--threads", "2", "--max-shard-size", "20K", "--rank",
                    str(rank), "--world-size", str(world))
        index = os.path.join(many, "model.safetensors.index.json")
        # The index appears only once every shard is in place: after the last rank.
        assert os.path.exists(index) == (rank == world - 1), p.stderr
    names = sorted(os.listdir(one))
    assert names == sorted(os.listdir(many))
    assert len([n for n in names if n.endswith(".safetensors")]) >= world
    for n in names:
        assert filecmp.cmp(os.path.join(one, n), os.path.join(many, n), shallow=False), n


def test_stale_index_never_survives_or_comes_early(root, tmp_path):
    import shutil
    dst = str(tmp_path / "out")
    index = os.path.join(dst, "model.safetensors.index.json")
    convert(root, "qwen2", dst, "--max-shard-size", "20K")
    assert os.path.exists(index)
    # A copy of the checkpoint (same bytes, other files: another run id). Its rank 0 of 2 must
    # not publish an index while rank 1's shards are those of the first run, sizes equal.
    src = str(tmp_path / "qwen2")
    shutil.copytree(os.path.join(root, "qwen2"), src)
    cfg = os.path.join(root, "qwen2-hf-config")
    args = ["convert", "--src", src, "--dst", dst, "--model", "qwen2", "--hf-config-dir", cfg,
            "--max-shard-size", "20K", "--world-size", "2"]
    p = run(*args, "--rank", "0")
    assert not os.path.exists(index), p.stderr
    p = run(*args, "--rank", "1")
    assert os.path.exists(index), p.stderr
    got, _ = read_output(dst)
    assert_bit_identical(got, torch.load(os.path.join(root, "qwen2-ref.pt")))
    # A re-run that fails leaves no index naming shards it deleted.
    with open(os.path.join(src, "__1_0.distcp"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(src, "__1_0.distcp")) // 2)
    p = run("convert", "--src", src, "--dst", dst, "--model", "qwen2", "--hf-config-dir", cfg,
            "--max-shard-size", "20K", check=False)
    assert p.returncode == 1, p.stderr
    assert not os.path.exists(index)


def output_files(dst):
    names = sorted(os.listdir(dst))
    out = {}
    for n in names:
        with open(os.path.join(dst, n), "rb") as f:
            out[n] = f.read()
    return out


def test_one_shard_identical_for_any_threads(root, tmp_path):
    # The whole model in one shard: every thread writes into the same file, in an order that
    # differs run to run; the bytes must not.
    outs = {}
    for threads in ("1", "2", "7"):
        dst = str(tmp_path / ("t" + threads))
        convert(root, "llama", dst, "--threads", threads)
        outs[threads] = output_files(dst)
    assert len([n for n in outs["1"] if n.endswith(".safetensors")]) == 1
    assert outs["2"] == outs["1"] and outs["7"] == outs["1"]
    got, _ = read_output(str(tmp_path / "t7"))
    assert_bit_identical(got, torch.load(os.path.join(root, "llama-ref.pt")))


def test_tiny_mem_budget(root, tmp_path):
    want = str(tmp_path / "want")
    convert(root, "deepseek_v3", want, "--threads", "1")
    # 6 KiB for 7 threads: 3 threads with 1 KiB windows, smaller than the larger chunks, which
    # are then copied in several windows.
    dst = str(tmp_path / "tiny")
    p = convert(root, "deepseek_v3", dst, "--threads", "7", "--mem-budget", "6K", "--verify")
    assert "using 3" in p.stderr, p.stderr
    assert output_files(dst) == output_files(want)
    # Below two minimum windows: refused, with the minimum named, and nothing written.
    bad = str(tmp_path / "bad")
    p = convert(root, "deepseek_v3", bad, "--mem-budget", "1K", check=False)
    assert p.returncode != 0 and "below the minimum" in p.stderr and "2KiB" in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(bad, "model.safetensors.index.json"))


def test_slurm_environment_gives_rank(root, tmp_path):
    dst = str(tmp_path / "out")
    env = dict(os.environ, SLURM_PROCID="1", SLURM_NTASKS="2")
    p = subprocess.run([BIN, "convert", "--src", os.path.join(root, "llama"), "--dst", dst,
                        "--model", "llama", "--hf-config-dir",
                        os.path.join(root, "llama-hf-config"), "--max-shard-size", "20K"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "rank 1/2" in p.stderr
    assert not os.path.exists(os.path.join(dst, "model.safetensors.index.json"))
    assert "model.safetensors.index.json NOT written" in p.stderr, p.stderr


def test_slurm_rank_and_world_size_each_on_its_own(root, tmp_path):
    base = [BIN, "convert", "--src", os.path.join(root, "qwen3"), "--model", "qwen3",
            "--hf-config-dir", os.path.join(root, "qwen3-hf-config"), "--max-shard-size", "20K"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}

    def go(name, *args, **env):
        return subprocess.run(base + ["--dst", str(tmp_path / name), *args],
                              env=dict(clean, **env), capture_output=True, text=True, timeout=60)

    # --world-size alone under srun: the rank still comes from Slurm.
    p = go("a", "--world-size", "3", SLURM_PROCID="2", SLURM_NTASKS="8")
    assert p.returncode == 0 and "rank 2 (from SLURM_PROCID) of 3 (from --world-size)" in p.stderr, \
        p.stderr
    # --rank alone: the step's task count wins over the allocation's.
    p = go("b", "--rank", "1", SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="2")
    assert p.returncode == 0 and "rank 1 (from --rank) of 2 (from SLURM_STEP_NUM_TASKS)" \
        in p.stderr, p.stderr
    # Inconsistent combinations and garbage are refused before anything is written.
    for name, args, env in (("c", ["--rank", "3"], {"SLURM_NTASKS": "2"}),
                            ("d", [], {"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}),
                            ("e", ["--world-size", "0"], {}),
                            ("f", [], {"SLURM_PROCID": "one", "SLURM_NTASKS": "2"})):
        p = go(name, *args, **env)
        assert p.returncode == 1, (name, p.stderr)
        assert ("do not fit" in p.stderr) or ("not a non-negative integer" in p.stderr), p.stderr
        assert not os.path.exists(tmp_path / name)


def test_iteration_directory_and_release(root, tmp_path):
    # A torch_dist save directory: latest_checkpointed_iteration.txt names iter_NNNNNNN or
    # "release", as for legacy checkpoints.
    import shutil
    for tracker, sub in (("20\n", "iter_0000020"), ("release", "release")):
        top = tmp_path / sub.replace("_", "")
        shutil.copytree(os.path.join(root, "qwen3"), top / sub)
        (top / "latest_checkpointed_iteration.txt").write_text(tracker)
        p = run("inspect", str(top))
        assert "decoder.layers.self_attention.linear_qkv.weight BF16 [4,128,32] 4 chunks" \
            in p.stdout, p.stdout
        dst = str(tmp_path / ("out" + sub))
        run("convert", "--src", str(top), "--dst", dst, "--model", "qwen3", "--hf-config-dir",
            os.path.join(root, "qwen3-hf-config"))
        got, _ = read_output(dst)
        assert_bit_identical(got, torch.load(os.path.join(root, "qwen3-ref.pt")))
    # A legacy checkpoint released the same way.
    top = tmp_path / "legacyrelease"
    shutil.copytree(os.path.join(root, "llama-legacy", "iter_0000010"), top / "release")
    (top / "latest_checkpointed_iteration.txt").write_text("release")
    p = run("inspect", str(top))
    assert "decoder.layers.self_attention.linear_qkv.weight" in p.stdout, p.stdout


def test_max_shard_size_below_a_tensor_warns(root, tmp_path):
    p = convert(root, "qwen3", str(tmp_path / "out"), "--max-shard-size", "2K")
    assert "--max-shard-size 2K is smaller than" in p.stderr and "largest" in p.stderr, p.stderr


def test_inspect_and_dry_run(root, tmp_path):
    p = run("inspect", os.path.join(root, "qwen3"))
    assert "decoder.layers.self_attention.linear_qkv.weight BF16 [4,128,32] 4 chunks" in p.stdout
    assert "_extra_state" in p.stdout
    dst = str(tmp_path / "out")
    p = convert(root, "qwen3", dst, "--dry-run-plan")
    assert "model.layers.3.self_attn.k_norm.weight" in p.stdout
    assert not os.path.exists(dst)


def test_mismatches_fail_clearly(root, tmp_path):
    ckpt = os.path.join(root, "llama")
    # Wrong family for the checkpoint: qwen3 wants q_layernorm.
    p = run("convert", "--src", ckpt, "--dst", str(tmp_path / "a"), "--model", "qwen3",
            "--hf-config-dir", os.path.join(root, "llama-hf-config"), check=False)
    assert p.returncode != 0 and "q_layernorm" in p.stderr
    # Config that disagrees with the checkpoint.
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    cfg = json.load(open(os.path.join(root, "llama-hf-config", "config.json")))
    cfg["num_hidden_layers"] = 3
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    p = run("convert", "--src", ckpt, "--dst", str(tmp_path / "b"), "--model", "llama",
            "--hf-config-dir", str(cfg_dir), check=False)
    assert p.returncode != 0 and "num_hidden_layers" in p.stderr
    p = run("convert", "--src", ckpt, "--dst", str(tmp_path / "c"), "--model", "gpt2",
            "--hf-config-dir", os.path.join(root, "llama-hf-config"), check=False)
    assert p.returncode != 0 and "unknown --model" in p.stderr
    p = run("inspect", str(tmp_path), check=False)
    assert p.returncode != 0 and ".metadata" in p.stderr


def test_truncated_and_corrupt_chunks(root, tmp_path):
    import shutil
    bad = str(tmp_path / "bad")
    # qwen2: no optimizer state, whose chunks would fill the second half of the files.
    shutil.copytree(os.path.join(root, "qwen2"), bad)
    shutil.copytree(os.path.join(root, "qwen2-hf-config"), bad + "-hf-config")
    victim = os.path.join(bad, "__1_0.distcp")
    size = os.path.getsize(victim)
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    p = run("convert", "--src", bad, "--dst", str(tmp_path / "o1"), "--model", "qwen2",
            "--hf-config-dir", bad + "-hf-config", check=False)
    assert p.returncode != 0 and "__1_0.distcp" in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(tmp_path, "o1", "model.safetensors.index.json"))
    # Garbage instead of the archives: clean error, no crash.
    with open(victim, "wb") as f:
        f.write(os.urandom(size))
    p = run("convert", "--src", bad, "--dst", str(tmp_path / "o2"), "--model", "qwen2",
            "--hf-config-dir", bad + "-hf-config", check=False)
    assert p.returncode == 1 and "bragg-reshard:" in p.stderr, p.stderr
    # A .metadata that is not a pickle.
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        f.write(b"\x80\x04garbage")
    p = run("inspect", bad, check=False)
    assert p.returncode == 1 and "pickle" in p.stderr


@pytest.mark.parametrize("family", LEGACY_FAMILIES)
def test_legacy_format_matches_reference(root, tmp_path, family):
    dst = str(tmp_path / "out")
    convert(root, family + "-legacy", dst, "--threads", "2", "--max-shard-size", "30K",
            "--verify")
    got, _ = read_output(dst)
    assert_bit_identical(got, torch.load(os.path.join(root, family + "-ref.pt")))


def test_legacy_moe_per_layer_keys_and_fused(root, tmp_path):
    # Mixed dense/MoE layers are indexed with per-layer keys, grouped-GEMM experts on an axis.
    p = run("inspect", os.path.join(root, "deepseek_v3-legacy"))
    assert "decoder.layers.3.mlp.experts.experts.linear_fc1.weight BF16 [4,32,32] 16 chunks" \
        in p.stdout, p.stdout
    assert "decoder.layers.0.mlp.linear_fc1.weight BF16 [96,32]" in p.stdout
    dst = str(tmp_path / "out")
    convert(root, "deepseek_v3-legacy", dst, "--fused-gate-up", "--verify")
    got, _ = read_output(dst)
    cfg = megatron_fixture.make_config("deepseek_v3")
    want = megatron_fixture.reference(os.path.join(root, "deepseek_v3"), cfg, "deepseek_v3",
                                      fused=True)
    assert_bit_identical(got, want)


def test_legacy_expert_parallel_without_pipeline(root, tmp_path):
    # mp_rank_TT_EEE: the saved args tell the EP rank from a PP rank.
    assert os.path.isdir(os.path.join(root, "qwen3_moe-legacyep", "iter_0000010", "mp_rank_01_001"))
    dst = str(tmp_path / "out")
    convert(root, "qwen3_moe-legacyep", dst, "--verify")
    got, _ = read_output(dst)
    assert_bit_identical(got, torch.load(os.path.join(root, "qwen3_moe-ref.pt")))


def test_legacy_missing_expert_rank_fails(root, tmp_path):
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(os.path.join(root, "deepseek_v3-legacy"), bad)
    shutil.rmtree(os.path.join(bad, "iter_0000010", "mp_rank_01_001_001"))
    p = run("inspect", bad, check=False)
    assert p.returncode == 1 and "tp=1 pp=1 ep=1 is missing" in p.stderr, p.stderr


def test_legacy_missing_rank_fails(root, tmp_path):
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(os.path.join(root, "llama-legacy"), bad)
    shutil.rmtree(os.path.join(bad, "iter_0000010", "mp_rank_01_001"))
    p = run("inspect", bad, check=False)
    assert p.returncode != 0 and "tp=1 pp=1 is missing" in p.stderr, p.stderr


def test_deepseek_v3_layout(root, tmp_path):
    dst = str(tmp_path / "out")
    convert(root, "deepseek_v3", dst)
    got, _ = read_output(dst)
    # Layer 0 dense, layers 1-3 MoE with shared experts and an fp32 router bias.
    assert "model.layers.0.mlp.gate_proj.weight" in got
    assert "model.layers.0.mlp.gate.weight" not in got
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tuple(got["model.layers.3.mlp.experts.3.down_proj.weight"].shape) == (32, 16)
    assert tuple(got["model.layers.2.mlp.shared_experts.up_proj.weight"].shape) == (32, 32)
    assert tuple(got["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"].shape) == (20, 32)
    assert tuple(got["model.layers.2.self_attn.kv_b_proj.weight"].shape) == (64, 16)
    assert tuple(got["model.layers.2.self_attn.q_b_proj.weight"].shape) == (48, 24)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fused_gate_up_matches_reference(root, tmp_path, family):
    dst = str(tmp_path / "out")
    convert(root, family, dst, "--fused-gate-up", "--threads", "2", "--max-shard-size", "30K",
            "--verify")
    got, _ = read_output(dst)
    ckpt = os.path.join(root, family)
    cfg = megatron_fixture.make_config(family)
    want = megatron_fixture.reference(ckpt, cfg, family, fused=True)
    assert_bit_identical(got, want)
    assert tuple(got["model.layers.1.mlp.experts.gate_up_proj"].shape) == (4, 32, 32)
    assert not [n for n in got if ".experts.0." in n]


def test_fused_gate_up_needs_moe(root, tmp_path):
    p = convert(root, "llama", str(tmp_path / "out"), "--fused-gate-up", check=False)
    assert p.returncode == 1 and "--fused-gate-up" in p.stderr, p.stderr


def test_deepseek_v3_hostile(root, tmp_path):
    import pickle
    import shutil
    bad = str(tmp_path / "bad")
    shutil.copytree(os.path.join(root, "deepseek_v3"), bad)
    # A checkpoint without one MLA tensor (kv_a_layernorm of layer 2).
    victim = "decoder.layers.2.self_attention.linear_kv_up_proj.layer_norm_weight"
    with open(os.path.join(bad, ".metadata"), "rb") as f:
        md = pickle.load(f)
    del md.state_dict_metadata[victim]
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != victim}
    with open(os.path.join(bad, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    cfg_dir = os.path.join(root, "deepseek_v3-hf-config")
    p = run("convert", "--src", bad, "--dst", str(tmp_path / "o1"), "--model", "deepseek_v3",
            "--hf-config-dir", cfg_dir, check=False)
    assert p.returncode == 1 and victim in p.stderr, p.stderr
    assert "kv_a_layernorm" in p.stderr
    # A config whose MLA ranks disagree with the checkpoint's shapes.
    for field, value, hf_name in (("kv_lora_rank", 12, "kv_a_proj_with_mqa"),
                                  ("q_lora_rank", None, "q_proj"),
                                  ("n_routed_experts", 8, "mlp.gate.weight"),
                                  ("first_k_dense_replace", 2, "model.layers.1.")):
        wrong = tmp_path / f"cfg-{field}"
        wrong.mkdir()
        cfg = megatron_fixture.make_config("deepseek_v3")
        cfg[field] = value
        (wrong / "config.json").write_text(json.dumps(cfg))
        p = run("convert", "--src", os.path.join(root, "deepseek_v3"), "--dst",
                str(tmp_path / f"o-{field}"), "--model", "deepseek_v3", "--hf-config-dir",
                str(wrong), check=False)
        assert p.returncode == 1 and hf_name in p.stderr, (field, p.stderr)
        assert not os.path.exists(tmp_path / f"o-{field}" / "model.safetensors.index.json")
    # The wrong family for an MLA checkpoint.
    p = run("convert", "--src", os.path.join(root, "deepseek_v3"), "--dst", str(tmp_path / "o3"),
            "--model", "qwen3_moe", "--hf-config-dir", os.path.join(root, "qwen3_moe-hf-config"),
            check=False)
    assert p.returncode == 1 and "linear_qkv" in p.stderr, p.stderr


def test_legacy_huge_index_in_a_key_fails_clearly(root, tmp_path):
    # A key whose expert or layer index does not fit: a clear error, not an exception or an
    # overflow.
    import shutil
    for old, new in [("local_experts.0.", "local_experts.99999999999999999999999999."),
                     ("decoder.layers.", "decoder.layers.99999999999999999999")]:
        bad = str(tmp_path / f"bad{len(new)}")
        shutil.copytree(os.path.join(root, "qwen3_moe-legacy"), bad)
        rank = os.path.join(bad, "iter_0000010", sorted(
            os.listdir(os.path.join(bad, "iter_0000010")))[0], "model_optim_rng.pt")
        state = torch.load(rank)
        keys = [k for k in state["model"] if old in k]
        assert keys, list(state["model"])[:10]
        state["model"][keys[0].replace(old, new, 1)] = state["model"].pop(keys[0])
        torch.save(state, rank)
        p = run("inspect", bad, check=False)
        assert p.returncode == 1 and "out of range" in p.stderr, p.stderr
