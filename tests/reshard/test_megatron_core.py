"""bragg-reshard against code no one here wrote.

Checkpoints written by megatron-core's own dist_checkpointing.save (megatron_core_fixture.py: a
transformers model's weights in megatron-core's GPTModel, checked by megatron-core's forward,
resharded by megatron-core to TP 2 x PP 2, EP 2 x PP 2 for the MoE) are converted by bragg-reshard
and loaded by transformers.AutoModelForCausalLM.from_pretrained, whose logits must equal the
source model's. Runs under the Python peer environment (python/peers.lock)."""

import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import ray
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.environ.get("BRAGG_RESHARD")
if not BIN or not os.path.exists(BIN):
    pytest.fail("BRAGG_RESHARD (the bragg-reshard binary) not set", pytrace=False)
FIXTURE = os.path.join(HERE, "megatron_core_fixture.py")
LOCK = os.path.join(HERE, "..", "..", "python", "peers.lock")
FAMILIES = ["llama", "qwen3", "qwen3_moe"]
CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM"}
TOKENS = torch.tensor([[3, 17, 42, 99, 5, 64, 7, 120, 11, 2, 77, 31],
                       [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 127]])


def _fixture_key():
    h = hashlib.sha256()
    for path in (FIXTURE, LOCK):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """megatron-core's checkpoints, made once per machine for these inputs (the fixture script
    and the peer lock): kept under BRAGG_TEST_CACHE when it is writable, renamed into place only
    once complete, so an interrupted run never leaves a half-written one behind."""
    cache = os.environ.get("BRAGG_TEST_CACHE")
    if cache and os.access(cache, os.W_OK):
        parent = os.path.join(cache, "reshard-megatron-core")
    else:
        parent = str(tmp_path_factory.mktemp("megatron-core"))
    final = os.path.join(parent, _fixture_key())
    if os.path.exists(os.path.join(final, "forward.json")):
        return final
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="making-", dir=parent)
    try:
        subprocess.run([sys.executable, FIXTURE, "--root", work], check=True, timeout=500)
        os.rename(work, final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    # Older keys' fixtures (a changed fixture or lock) are dead weight.
    for name in os.listdir(parent):
        if name != os.path.basename(final) and not name.startswith("making-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return final


def reshard(*args, check=True):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"bragg-reshard {' '.join(args)} failed: {p.stderr}")
    return p


@pytest.fixture(scope="module")
def converted(root, tmp_path_factory):
    """Every checkpoint converted once, --model taken from the config's model_type."""
    out = str(tmp_path_factory.mktemp("hf"))
    names = FAMILIES + [f + "-tp1" for f in FAMILIES] + ["llama-optim"]
    for name in names:
        family = name.split("-")[0]
        reshard("convert", "--src", os.path.join(root, name), "--dst", os.path.join(out, name),
                "--hf-config-dir", os.path.join(root, family + "-src"), "--threads", "2")
    return out


def same_but_run_id(a, b):
    """Two safetensors files hold the same header (but for __metadata__'s bragg_run_id, which
    names the source checkpoint) and the same bytes."""
    def parts(path):
        with open(path, "rb") as f:
            data = f.read()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        meta = header.pop("__metadata__")
        assert set(meta) == {"format", "bragg_run_id"}, meta
        return header, data[8 + n:]
    return parts(a) == parts(b)


def logits(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return type(model).__name__, model(TOKENS).logits


def test_megatron_core_forward_agrees_with_transformers(root):
    # The mapping the fixture puts weights into megatron-core with is checked by megatron-core's
    # own forward pass: were it wrong, bragg-reshard could be equally wrong and still round-trip.
    with open(os.path.join(root, "forward.json")) as f:
        forward = json.load(f)
    assert sorted(forward) == sorted(FAMILIES)
    for family, delta in forward.items():
        assert delta <= 1e-5, f"{family}: megatron-core's logits differ from transformers' by {delta}"


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loads_the_output_with_the_source_logits(root, converted, family):
    src_class, want = logits(os.path.join(root, family + "-src"))
    got_class, got = logits(os.path.join(converted, family))
    assert got_class == src_class == CLASSES[family]
    delta = float((got - want).abs().max())
    assert delta <= 1e-6, f"{family}: max |logit difference| {delta}"


@pytest.mark.parametrize("family", FAMILIES)
def test_tensors_equal_the_source_bit_for_bit(root, converted, family):
    from safetensors.torch import load_file
    src = load_file(os.path.join(root, family + "-src", "model.safetensors"))
    got = {}
    with open(os.path.join(converted, family, "model.safetensors.index.json")) as f:
        index = json.load(f)
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(os.path.join(converted, family, shard)))
    assert sorted(got) == sorted(src)
    for name, want in src.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].view(torch.int32), want.view(torch.int32)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_any_parallel_layout_gives_the_same_bytes(converted, family):
    # Data parallel 4 (every tensor whole, saved by four ranks) against TP 2 x PP 2 (EP 2 x PP 2).
    a, b = os.path.join(converted, family), os.path.join(converted, family + "-tp1")
    shards = sorted(f for f in os.listdir(a) if f.endswith(".safetensors"))
    assert shards and shards == sorted(f for f in os.listdir(b) if f.endswith(".safetensors"))
    for s in shards:
        assert same_but_run_id(os.path.join(a, s), os.path.join(b, s)), s


def test_optimizer_state_beside_the_model_is_skipped(root, converted):
    p = reshard("inspect", os.path.join(root, "llama-optim"))
    skipped = [line for line in p.stdout.splitlines() if "non-model state, skipped" in line]
    assert any(line.startswith("optimizer.state.exp_avg.") for line in skipped), p.stdout[-2000:]
    assert any(line.startswith("optimizer.state.exp_avg_sq.") for line in skipped)
    a, b = os.path.join(converted, "llama"), os.path.join(converted, "llama-optim")
    assert same_but_run_id(os.path.join(a, "model-00001-of-00001.safetensors"),
                           os.path.join(b, "model-00001-of-00001.safetensors"))


def test_model_defaults_from_model_type_and_mismatches_fail(root, tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    with open(os.path.join(root, "qwen3-src", "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"] = "mistral"
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    p = reshard("convert", "--src", os.path.join(root, "qwen3"), "--dst", str(tmp_path / "o1"),
                "--hf-config-dir", str(cfg_dir), check=False)
    assert p.returncode != 0
    assert "model_type 'mistral' is not supported (supported: llama, qwen2, qwen3" in p.stderr
    # The wrong family given explicitly: qwen3's q/k norms have no llama mapping.
    p = reshard("convert", "--src", os.path.join(root, "qwen3"), "--dst", str(tmp_path / "o2"),
                "--model", "llama", "--hf-config-dir", os.path.join(root, "qwen3-src"),
                check=False)
    assert p.returncode != 0, p.stderr
    assert "_layernorm.weight' [4,24] has no Hugging Face mapping for --model llama" in p.stderr
    # The MoE checkpoint read as dense: no linear_fc1 for the MLP.
    p = reshard("convert", "--src", os.path.join(root, "qwen3_moe"), "--dst",
                str(tmp_path / "o3"), "--model", "qwen3",
                "--hf-config-dir", os.path.join(root, "qwen3-src"), check=False)
    assert p.returncode != 0 and "does --model match the checkpoint" in p.stderr, p.stderr


def test_ray_ranks_write_what_the_rank_split_writes(root, converted, tmp_path):
    from bragg_reshard import ray as reshard_ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        nodes = reshard_ray.convert(os.path.join(root, "qwen3_moe"), tmp_path / "ray", 3,
                                    hf_config_dir=os.path.join(root, "qwen3_moe-src"),
                                    extra_args=["--max-shard-size", "200KB", "--threads", "1"],
                                    binary=BIN)
        assert sorted(nodes) == [0, 1, 2]
        # The same split by hand, rank by rank: the same files, byte for byte.
        for r in range(3):
            reshard("convert", "--src", os.path.join(root, "qwen3_moe"), "--dst",
                    str(tmp_path / "ranks"), "--hf-config-dir",
                    os.path.join(root, "qwen3_moe-src"), "--max-shard-size", "200KB",
                    "--rank", str(r), "--world-size", "3")
        files = sorted(os.listdir(tmp_path / "ranks"))
        assert len([f for f in files if f.endswith(".safetensors")]) > 3
        assert files == sorted(os.listdir(tmp_path / "ray"))
        for f in files:
            assert filecmp.cmp(tmp_path / "ranks" / f, tmp_path / "ray" / f, shallow=False), f
        # and that is the whole model: transformers gives the source's logits.
        _, want = logits(os.path.join(root, "qwen3_moe-src"))
        _, got = logits(str(tmp_path / "ray"))
        assert float((got - want).abs().max()) <= 1e-6
        # A rank that fails is named, with its log.
        with pytest.raises(reshard_ray.ConversionError) as e:
            reshard_ray.convert(os.path.join(root, "qwen3_moe"), tmp_path / "bad", 2,
                                hf_config_dir=os.path.join(root, "qwen3_moe-src"),
                                model="llama", binary=BIN)
        assert sorted(e.value.failures) == [0, 1]
        assert "does --model match" in str(e.value)
    finally:
        ray.shutdown()
