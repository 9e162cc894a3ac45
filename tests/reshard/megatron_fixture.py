"""Writes tiny Megatron-shaped torch_dist checkpoints with Debian's torch 1.13, and converts them
to Hugging Face tensors with a plain torch reference converter.

The checkpoint is written the way Megatron-core writes one: every rank of a TP x PP grid saves
its local shards of the global (layer-stacked) tensors through PyTorch's distributed checkpoint
writer, as separate gloo processes on loopback.

Usage (the test drives it):
  megatron_fixture.py all --root DIR [--families llama,qwen2,qwen3,qwen3_moe] [--tp 2 --pp 2]
                          [--seed 1234]
writes DIR/<family> (torch 1.13 class paths), DIR/<family>-hf-config, DIR/<family>-ref.pt (the
reference conversion), and two variants of llama: DIR/llama-newpaths (the
torch.distributed.checkpoint.metadata class paths and 5-tuple TensorProperties state that newer
PyTorch pickles) and DIR/llama-transforms (a chunk with transform_descriptors, which
bragg-reshard must refuse). The llama checkpoints also carry optimizer state beside the model, as
Megatron saves it (optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<param>, chunked like the
parameter, and rng_state objects), which bragg-reshard must skip.
"""

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import io
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import types

_PATCHED = "torch.distributed._shard.sharded_tensor.metadata"


class _PatchedMetadataFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves sharded_tensor/metadata.py with its dataclass default fixed.

    Debian's torch 1.13 declares `tensor_properties: TensorProperties =
    field(default=TensorProperties())`, which Python 3.11's dataclasses reject ("mutable default
    ... for field tensor_properties"), so `torch.distributed._shard` cannot be imported at all.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname != _PATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        self._origin = spec.origin
        return importlib.util.spec_from_file_location(fullname, spec.origin, loader=self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        with open(self._origin) as f:
            src = f.read()
        src = src.replace("field(default=TensorProperties())",
                          "field(default_factory=TensorProperties)")
        exec(compile(src, self._origin, "exec"), module.__dict__)


def install_import_fix():
    if not any(isinstance(f, _PatchedMetadataFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchedMetadataFinder())


install_import_fix()
import torch  # noqa: E402


# ---------------------------------------------------------------------------------------------
# The model: global Megatron tensors, deterministic.

def family_of(name):
    """'deepseek_v3-qproj' -> 'deepseek_v3': a fixture name is the family plus a variant."""
    return name.split("-")[0]


# What transformers names each family's model class (what an engine loading the converted
# directory reads first).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def make_config(name):
    family = family_of(name)
    if family == "deepseek_v3":
        # DeepSeek-V3 / Kimi-K2 shaped: MLA, the first layer dense, then MoE with shared experts.
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": None if name.endswith("-qproj") else 24,
            "kv_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 8,
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "n_routed_experts": 4,
            "n_shared_experts": 2,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "vocab_size": 50,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    cfg = {
        "architectures": [ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "vocab_size": 50,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if family in ("qwen3", "qwen3_moe"):
        cfg["head_dim"] = 16  # differs from hidden/heads, as in real Qwen3
    if family == "qwen3_moe":
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


def deepseek_tensors(cfg, r):
    """Megatron's per-layer keys (MoE models are saved with non-homogeneous layers)."""
    L, h, nh = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    qlr, kvlr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    E, f = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    sf = f * cfg["n_shared_experts"]
    t = {}
    for i in range(L):
        p = f"decoder.layers.{i}."
        a = p + "self_attention."
        t[p + "input_layernorm.weight"] = r(h)
        if qlr:
            t[a + "linear_q_down_proj.weight"] = r(qlr, h)
            t[a + "linear_q_up_proj.layer_norm_weight"] = r(qlr)
            t[a + "linear_q_up_proj.weight"] = r(nh * (nope + rope), qlr)
        else:
            t[a + "linear_q_proj.weight"] = r(nh * (nope + rope), h)
        t[a + "linear_kv_down_proj.weight"] = r(kvlr + rope, h)
        t[a + "linear_kv_up_proj.layer_norm_weight"] = r(kvlr)
        t[a + "linear_kv_up_proj.weight"] = r(nh * (nope + vd), kvlr)
        t[a + "linear_proj.weight"] = r(h, nh * vd)
        if i < cfg["first_k_dense_replace"]:
            t[p + "mlp.linear_fc1.layer_norm_weight"] = r(h)
            t[p + "mlp.linear_fc1.weight"] = r(2 * cfg["intermediate_size"], h)
            t[p + "mlp.linear_fc2.weight"] = r(h, cfg["intermediate_size"])
            continue
        t[p + "pre_mlp_layernorm.weight"] = r(h)
        t[p + "mlp.router.weight"] = r(E, h)
        t[p + "mlp.router.expert_bias"] = r(E).float()  # Megatron keeps the bias in fp32
        t[p + "mlp.experts.experts.linear_fc1.weight"] = r(E, 2 * f, h)
        t[p + "mlp.experts.experts.linear_fc2.weight"] = r(E, h, f)
        t[p + "mlp.shared_experts.linear_fc1.weight"] = r(2 * sf, h)
        t[p + "mlp.shared_experts.linear_fc2.weight"] = r(h, sf)
    return t


DEFAULT_SEED = 1234


def global_tensors(name, cfg, seed=DEFAULT_SEED):
    """The model's global tensors, drawn from a generator seeded with `seed` (another seed, another
    checkpoint of the same shapes: `make demo` trains "step 0" and "step 1" that way)."""
    family = family_of(name)
    g = torch.Generator().manual_seed(seed)
    L, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    ffn, vocab = cfg["intermediate_size"], cfg["vocab_size"]
    padded = (vocab + 7) // 8 * 8 + 8  # Megatron pads the vocabulary
    qkv = (nh + 2 * nkv) * hd

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    p = "decoder.layers."
    t = {
        "embedding.word_embeddings.weight": r(padded, h),
        "output_layer.weight": r(padded, h),
        "decoder.final_layernorm.weight": r(h),
    }
    if family == "deepseek_v3":
        t.update(deepseek_tensors(cfg, r))
        return t
    t.update({
        p + "self_attention.linear_qkv.layer_norm_weight": r(L, h),
        p + "self_attention.linear_qkv.weight": r(L, qkv, h),
        p + "self_attention.linear_proj.weight": r(L, h, nh * hd),
        p + "mlp.linear_fc1.layer_norm_weight": r(L, h),
        p + "mlp.linear_fc1.weight": r(L, 2 * ffn, h),
        p + "mlp.linear_fc2.weight": r(L, h, ffn),
    })
    if family == "qwen2":
        t[p + "self_attention.linear_qkv.bias"] = r(L, qkv)
    if family in ("qwen3", "qwen3_moe"):
        t[p + "self_attention.q_layernorm.weight"] = r(L, hd)
        t[p + "self_attention.k_layernorm.weight"] = r(L, hd)
    if family == "qwen3_moe":
        E, f = cfg["num_experts"], cfg["moe_intermediate_size"]
        for k in ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
                  "mlp.linear_fc2.weight"):
            del t[p + k]
        t[p + "pre_mlp_layernorm.weight"] = r(L, h)
        t[p + "mlp.router.weight"] = r(L, E, h)
        t[p + "mlp.experts.experts.linear_fc1.weight"] = r(L, E, 2 * f, h)
        t[p + "mlp.experts.experts.linear_fc2.weight"] = r(L, E, h, f)
    return t


ROW_PARALLEL = ("linear_qkv.weight", "linear_qkv.bias", "linear_q_proj.weight",
                "linear_q_up_proj.weight", "linear_kv_up_proj.weight")
COL_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def chunks_for(key, shape, tp, pp, num_layers=None):
    """Megatron's sharding: yields (owner_rank, offsets, sizes). rank = pp_rank * tp + tp_rank.

    Layer tensors are either layer-stacked ("decoder.layers.X", layers on dim 0, split by
    pipeline stage) or per-layer ("decoder.layers.N.X", saved by the stage that owns layer N;
    `num_layers` is needed for those).
    Column-parallel weights (ROW_PARALLEL: their output rows) and row-parallel ones
    (COL_PARALLEL: their input columns) are split over TP; MLA's down projections, norms and the
    router are replicated; experts are split over EP (= the TP ranks, expert TP = 1).
    """
    m = re.match(r"decoder\.layers\.(\d+)\.", key)
    per_layer_stage = int(m.group(1)) // (num_layers // pp) if m else None
    stacked = key.startswith("decoder.layers.") and m is None
    out = []
    for pr in range(pp):
        for tr in range(tp):
            rank = pr * tp + tr
            off = [0] * len(shape)
            size = list(shape)
            if stacked:
                size[0] = shape[0] // pp
                off[0] = pr * size[0]
            elif per_layer_stage is not None:
                if pr != per_layer_stage:
                    continue
            elif key.startswith("embedding."):
                if pr != 0:
                    continue
            elif pr != pp - 1:
                continue  # final norm and output layer live on the last stage
            d = 1 if stacked else 0
            if ".experts.experts." in key:
                size[d] = shape[d] // tp
                off[d] = tr * size[d]
                out.append((rank, off, size))
                continue
            if key.endswith("linear_fc1.weight"):
                # Megatron's swiglu factory: each TP rank holds [gate_tp; up_tp] as two chunks of
                # the global [gate; up].
                half = shape[d] // 2
                n = half // tp
                for base in (0, half):
                    o, s = list(off), list(size)
                    o[d], s[d] = base + tr * n, n
                    out.append((rank, o, s))
                continue
            split = None
            if key.endswith(ROW_PARALLEL) or key.startswith(("embedding.", "output_layer.")):
                split = d
            elif key.endswith(COL_PARALLEL):
                split = len(shape) - 1
            if split is None:
                if tr != 0:
                    continue  # replicated across TP: tp rank 0 saves it
            else:
                size[split] = shape[split] // tp
                off[split] = tr * size[split]
            out.append((rank, off, size))
    return out


# ---------------------------------------------------------------------------------------------
# Writing: one gloo process per rank.

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_rank(args):
    import torch.distributed as dist

    world = args.tp * args.pp
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=world)
    for family in args.families.split(","):
        write_family(args, family, os.path.join(args.root, family))
    dist.barrier()
    dist.destroy_process_group()


def write_family(args, family, out):
    from torch.distributed._shard.checkpoint import FileSystemWriter, save_state_dict
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                  TensorProperties)
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    cfg = make_config(family)
    tensors = global_tensors(family, cfg, args.seed)
    if family in OPTIMIZER_STATE:
        # Megatron saves the optimizer's state of each parameter in the same checkpoint, chunked
        # like the parameter: Adam's moments and the fp32 master weights.
        for key, full in list(tensors.items()):
            for i, slot in enumerate(("exp_avg", "exp_avg_sq", "fp32_param")):
                tensors[f"optimizer.state.{slot}.{key}"] = full.float() * (i + 2)
    state = {}
    for key, full in tensors.items():
        chunks = chunks_for(key.split(".", 3)[-1] if key.startswith("optimizer.") else key,
                            full.shape, args.tp, args.pp, cfg["num_hidden_layers"])
        metas = [ShardMetadata(o, s, f"rank:{r}/cpu") for r, o, s in chunks]
        local = []
        for (r, o, s), m in zip(chunks, metas):
            if r == args.rank:
                view = full
                for d in range(len(o)):
                    view = view.narrow(d, o[d], s[d])
                local.append(Shard(view.contiguous(), m))
        st_meta = ShardedTensorMetadata(metas, full.shape,
                                        TensorProperties(dtype=full.dtype))
        state[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
            local, st_meta, sharding_spec=EnumerableShardingSpec(metas))
    if args.rank == 0:
        # Transformer Engine's _extra_state travels as a bytes item.
        state["decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2"] = io.BytesIO(
            b"te-extra-state")
    if family in OPTIMIZER_STATE:
        # Megatron's RNG state: one ShardedObject (a bytes item) per TP x PP rank.
        pr, tr = divmod(args.rank, args.tp)
        state[f"rng_state/shard_{pr}.{tr}_{args.pp}.{args.tp}"] = io.BytesIO(b"rng")
    save_state_dict(state, FileSystemWriter(out, single_file_per_rank=True))


def write_legacy(root, name, tp, pp, out_name=None, seed=DEFAULT_SEED):
    """The legacy format of the same model: iter_0000010/mp_rank_TT_PPP[_EEE]/model_optim_rng.pt
    with local tensors and local layer indices, as Megatron's non-distributed save writes it.
    MoE models get one directory per expert-parallel rank (EP = TP, expert TP = TP): every EP rank
    repeats the dense tensors and holds its own experts, as SequentialMLP
    (mlp.experts.local_experts.K.linear_fcN.weight; qwen3_moe) or TEGroupedMLP
    (mlp.experts.linear_fcN.weightK; deepseek_v3) names them. Without pipeline parallelism the
    PP part of the directory name is left out (mp_rank_TT_EEE), as Megatron does."""
    import collections

    cfg = make_config(name)
    tensors = global_tensors(name, cfg, seed)
    L = cfg["num_hidden_layers"]
    per = L // pp
    experts = cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    ep = tp if experts else 1
    local_experts = experts // ep
    grouped = family_of(name) == "deepseek_v3"
    # (global layer or None, key suffix) -> the global tensor of that layer.
    items = collections.OrderedDict()
    for key, full in tensors.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)", key)
        if m:
            items[(int(m.group(1)), m.group(2))] = full
        elif key.startswith("decoder.layers."):
            for i in range(L):
                items[(i, key[len("decoder.layers."):])] = full[i]
        else:
            items[(None, key)] = full

    def tp_slice(key, t, tr):
        if key.endswith("linear_fc1.weight"):
            gate, up = torch.chunk(t, 2, dim=0)
            return torch.cat([torch.chunk(gate, tp, dim=0)[tr], torch.chunk(up, tp, dim=0)[tr]])
        if key.endswith(ROW_PARALLEL) or key.startswith(("embedding.", "output_layer.")):
            return torch.chunk(t, tp, dim=0)[tr]
        if key.endswith(COL_PARALLEL):
            return torch.chunk(t, tp, dim=t.dim() - 1)[tr]
        return t

    out_name = out_name or name + "-legacy"
    out = os.path.join(root, out_name)
    for pr in range(pp):
        for tr in range(tp):
            for er in range(ep):
                model = collections.OrderedDict()
                for (layer, suffix), full in items.items():
                    if layer is None:
                        if (pr != 0) if suffix.startswith("embedding.") else (pr != pp - 1):
                            continue
                        model[suffix] = tp_slice(suffix, full, tr).clone()
                        continue
                    if layer // per != pr:
                        continue
                    p = f"decoder.layers.{layer - pr * per}."
                    if ".experts.experts." in suffix:
                        fc = suffix.split(".")[-2]  # linear_fc1 / linear_fc2
                        for k in range(local_experts):
                            w = tp_slice(suffix, full[er * local_experts + k], tr).clone()
                            if grouped:
                                model[f"{p}mlp.experts.{fc}.weight{k}"] = w
                            else:
                                model[f"{p}mlp.experts.local_experts.{k}.{fc}.weight"] = w
                        continue
                    model[p + suffix] = tp_slice(suffix, full, tr).clone()
                    if suffix.endswith("linear_qkv.weight"):
                        model[p + suffix.replace("weight", "_extra_state")] = None
                rank = (f"mp_rank_{tr:02d}" + (f"_{pr:03d}" if pp > 1 else "") +
                        (f"_{er:03d}" if experts else ""))
                d = os.path.join(out, "iter_0000010", rank)
                os.makedirs(d, exist_ok=True)
                torch.save({"args": argparse.Namespace(tensor_model_parallel_size=tp,
                                                       pipeline_model_parallel_size=pp,
                                                       expert_model_parallel_size=ep),
                            "checkpoint_version": 3.0, "iteration": 10, "model": model},
                           os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("10")
    shutil_copy_config(root, name, out_name)


def shutil_copy_config(root, family, name):
    import shutil

    shutil.copytree(os.path.join(root, family + "-hf-config"),
                    os.path.join(root, name + "-hf-config"))


def rewrite_metadata(ckpt, variant):
    """Re-pickles .metadata as newer PyTorch would (class paths, TensorProperties state)."""
    from torch.distributed._shard.checkpoint import filesystem, metadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        md = pickle.load(f)
    if variant == "newpaths":
        new_md = types.ModuleType("torch.distributed.checkpoint.metadata")
        new_fs = types.ModuleType("torch.distributed.checkpoint.filesystem")
        sys.modules.setdefault("torch.distributed.checkpoint", types.ModuleType("x"))
        sys.modules["torch.distributed.checkpoint.metadata"] = new_md
        sys.modules["torch.distributed.checkpoint.filesystem"] = new_fs
        for cls in (metadata.Metadata, metadata.TensorStorageMetadata,
                    metadata.BytesStorageMetadata, metadata.ChunkStorageMetadata,
                    metadata.MetadataIndex, TensorProperties):
            setattr(new_md, cls.__name__, cls)
            cls.__module__ = new_md.__name__
        setattr(new_fs, "_StorageInfo", filesystem._StorageInfo)
        filesystem._StorageInfo.__module__ = new_fs.__name__
        TensorProperties.__getstate__ = lambda self: (self.dtype, self.layout,
                                                      self.requires_grad, self.memory_format,
                                                      self.pin_memory)
    elif variant == "transforms":
        info = next(iter(md.storage_data.values()))
        info.transform_descriptors = ["zstd"]
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(md, f)


LEGACY = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
# Fixtures saved with optimizer state beside the model (bragg-reshard skips it).
OPTIMIZER_STATE = ("llama",)


def write_all(root, families, tp, pp, seed=DEFAULT_SEED):
    """Writes root/<family> for every family (one set of gloo processes for all), the variants
    root/llama-newpaths and root/llama-transforms, HF config dirs root/<name>-hf-config and the
    reference conversions root/<family>-ref.pt."""
    import shutil

    os.makedirs(root, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(tp * pp):
        cmd = [sys.executable, __file__, "write-rank", "--root", root, "--families",
               ",".join(families), "--tp", str(tp), "--pp", str(pp), "--rank", str(rank),
               "--port", str(port), "--seed", str(seed)]
        procs.append(subprocess.Popen(cmd))
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        sys.exit(f"rank processes failed: {codes}")
    names = list(families)
    if "llama" in families:
        for variant in ("newpaths", "transforms"):
            name = f"llama-{variant}"
            shutil.copytree(os.path.join(root, "llama"), os.path.join(root, name))
            names.append(name)
    for name in names:
        family = family_of(name)
        ckpt = os.path.join(root, name)
        cfg = make_config(name)
        torch.save({"args": argparse.Namespace(tensor_model_parallel_size=tp,
                                               pipeline_model_parallel_size=pp),
                    "checkpoint_version": 3.0}, os.path.join(ckpt, "common.pt"))
        with open(os.path.join(ckpt, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)
        hf = ckpt + "-hf-config"
        os.makedirs(hf, exist_ok=True)
        with open(os.path.join(hf, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
            json.dump({"model_max_length": 128}, f)
        if name in families:
            torch.save(reference(ckpt, cfg, family), ckpt + "-ref.pt")
            if name in LEGACY:
                write_legacy(root, name, tp, pp, seed=seed)
            if name == "qwen3_moe":
                # Expert parallelism without pipeline parallelism: mp_rank_TT_EEE.
                write_legacy(root, name, tp, 1, out_name="qwen3_moe-legacyep", seed=seed)
    # Rewritten last: the reference reads the torch 1.13 class paths.
    if "llama" in families:
        for variant in ("newpaths", "transforms"):
            rewrite_metadata(os.path.join(root, f"llama-{variant}"), variant)


# ---------------------------------------------------------------------------------------------
# Reference converter: loads whole tensors with torch, then splits them (the slow, simple way).

def load_global(ckpt):
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        md = pickle.load(f)
    out = {}
    for fqn, meta in md.state_dict_metadata.items():
        if not hasattr(meta, "chunks"):
            continue
        full = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for c in meta.chunks:
            info = next(v for k, v in md.storage_data.items()
                        if k.fqn == fqn and tuple(k.offset) == tuple(c.offsets))
            with open(os.path.join(ckpt, info.relative_path), "rb") as f:
                f.seek(info.offset)
                t = torch.load(io.BytesIO(f.read(info.length)))
            view = full
            for d in range(len(c.offsets)):
                view = view.narrow(d, c.offsets[d], c.sizes[d])
            view.copy_(t)
        out[fqn] = full
    return out


def reference_deepseek_v3(g, cfg, fused):
    """DeepSeek-V3 / Kimi-K2: MLA projections copy whole; dense layers, then MoE layers."""
    hf = {}
    E = cfg["n_routed_experts"]
    for i in range(cfg["num_hidden_layers"]):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        a, o = p + "self_attention.", q + "self_attn."
        hf[q + "input_layernorm.weight"] = g[p + "input_layernorm.weight"]
        if cfg["q_lora_rank"]:
            hf[o + "q_a_proj.weight"] = g[a + "linear_q_down_proj.weight"]
            hf[o + "q_a_layernorm.weight"] = g[a + "linear_q_up_proj.layer_norm_weight"]
            hf[o + "q_b_proj.weight"] = g[a + "linear_q_up_proj.weight"]
        else:
            hf[o + "q_proj.weight"] = g[a + "linear_q_proj.weight"]
        hf[o + "kv_a_proj_with_mqa.weight"] = g[a + "linear_kv_down_proj.weight"]
        hf[o + "kv_a_layernorm.weight"] = g[a + "linear_kv_up_proj.layer_norm_weight"]
        hf[o + "kv_b_proj.weight"] = g[a + "linear_kv_up_proj.weight"]
        hf[o + "o_proj.weight"] = g[a + "linear_proj.weight"]

        def gated(prefix, fc1, fc2):
            gate, up = torch.chunk(fc1, 2, dim=0)
            hf[prefix + "gate_proj.weight"] = gate
            hf[prefix + "up_proj.weight"] = up
            hf[prefix + "down_proj.weight"] = fc2

        if i < cfg["first_k_dense_replace"]:
            hf[q + "post_attention_layernorm.weight"] = g[p + "mlp.linear_fc1.layer_norm_weight"]
            gated(q + "mlp.", g[p + "mlp.linear_fc1.weight"], g[p + "mlp.linear_fc2.weight"])
            continue
        hf[q + "post_attention_layernorm.weight"] = g[p + "pre_mlp_layernorm.weight"]
        hf[q + "mlp.gate.weight"] = g[p + "mlp.router.weight"]
        hf[q + "mlp.gate.e_score_correction_bias"] = g[p + "mlp.router.expert_bias"]
        fc1 = g[p + "mlp.experts.experts.linear_fc1.weight"]
        fc2 = g[p + "mlp.experts.experts.linear_fc2.weight"]
        if fused:
            hf[q + "mlp.experts.gate_up_proj"] = fc1
            hf[q + "mlp.experts.down_proj"] = fc2
        else:
            for e in range(E):
                gated(f"{q}mlp.experts.{e}.", fc1[e], fc2[e])
        gated(q + "mlp.shared_experts.", g[p + "mlp.shared_experts.linear_fc1.weight"],
              g[p + "mlp.shared_experts.linear_fc2.weight"])
    return hf


def reference(ckpt, cfg, family, fused=False):
    """Whole-tensor torch conversion; `fused`: MoE experts as transformers' stacked
    mlp.experts.gate_up_proj [E, 2F, H] and mlp.experts.down_proj [E, H, F]."""
    g = load_global(ckpt)
    if family == "deepseek_v3":
        vocab = cfg["vocab_size"]
        hf = {"model.embed_tokens.weight": g["embedding.word_embeddings.weight"][:vocab],
              "model.norm.weight": g["decoder.final_layernorm.weight"],
              "lm_head.weight": g["output_layer.weight"][:vocab]}
        hf.update(reference_deepseek_v3(g, cfg, fused))
        return {k: v.contiguous() for k, v in hf.items()}
    L, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    vocab, ffn = cfg["vocab_size"], cfg["intermediate_size"]
    p = "decoder.layers."
    hf = {"model.embed_tokens.weight": g["embedding.word_embeddings.weight"][:vocab],
          "model.norm.weight": g["decoder.final_layernorm.weight"],
          "lm_head.weight": g["output_layer.weight"][:vocab]}
    for i in range(L):
        q = f"model.layers.{i}."
        qkv = g[p + "self_attention.linear_qkv.weight"][i].reshape(nkv, (nh // nkv + 2) * hd, h)
        qw, kw, vw = torch.split(qkv, [nh // nkv * hd, hd, hd], dim=1)
        hf[q + "self_attn.q_proj.weight"] = qw.reshape(-1, h)
        hf[q + "self_attn.k_proj.weight"] = kw.reshape(-1, h)
        hf[q + "self_attn.v_proj.weight"] = vw.reshape(-1, h)
        if family == "qwen2":
            b = g[p + "self_attention.linear_qkv.bias"][i].reshape(nkv, -1)
            qb, kb, vb = torch.split(b, [nh // nkv * hd, hd, hd], dim=1)
            hf[q + "self_attn.q_proj.bias"] = qb.reshape(-1)
            hf[q + "self_attn.k_proj.bias"] = kb.reshape(-1)
            hf[q + "self_attn.v_proj.bias"] = vb.reshape(-1)
        if family in ("qwen3", "qwen3_moe"):
            hf[q + "self_attn.q_norm.weight"] = g[p + "self_attention.q_layernorm.weight"][i]
            hf[q + "self_attn.k_norm.weight"] = g[p + "self_attention.k_layernorm.weight"][i]
        hf[q + "input_layernorm.weight"] = g[p + "self_attention.linear_qkv.layer_norm_weight"][i]
        hf[q + "self_attn.o_proj.weight"] = g[p + "self_attention.linear_proj.weight"][i]
        if family == "qwen3_moe":
            hf[q + "post_attention_layernorm.weight"] = g[p + "pre_mlp_layernorm.weight"][i]
            hf[q + "mlp.gate.weight"] = g[p + "mlp.router.weight"][i]
            if fused:
                hf[q + "mlp.experts.gate_up_proj"] = g[p + "mlp.experts.experts.linear_fc1.weight"][i]
                hf[q + "mlp.experts.down_proj"] = g[p + "mlp.experts.experts.linear_fc2.weight"][i]
                continue
            for e in range(cfg["num_experts"]):
                fc1 = g[p + "mlp.experts.experts.linear_fc1.weight"][i, e]
                gate, up = torch.chunk(fc1, 2, dim=0)
                x = f"{q}mlp.experts.{e}."
                hf[x + "gate_proj.weight"] = gate
                hf[x + "up_proj.weight"] = up
                hf[x + "down_proj.weight"] = g[p + "mlp.experts.experts.linear_fc2.weight"][i, e]
            continue
        hf[q + "post_attention_layernorm.weight"] = g[p + "mlp.linear_fc1.layer_norm_weight"][i]
        gate, up = torch.chunk(g[p + "mlp.linear_fc1.weight"][i], 2, dim=0)
        hf[q + "mlp.gate_proj.weight"] = gate
        hf[q + "mlp.up_proj.weight"] = up
        hf[q + "mlp.down_proj.weight"] = g[p + "mlp.linear_fc2.weight"][i]
    return {k: v.contiguous() for k, v in hf.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["all", "write-rank"])
    ap.add_argument("--root", required=True)
    ap.add_argument("--families",
                    default="llama,qwen2,qwen3,qwen3_moe,deepseek_v3,deepseek_v3-qproj")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED,
                    help="seed of the weights (the same seed writes the same checkpoint)")
    args = ap.parse_args()
    if args.cmd == "all":
        write_all(args.root, args.families.split(","), args.tp, args.pp, args.seed)
    else:
        write_rank(args)


if __name__ == "__main__":
    main()
