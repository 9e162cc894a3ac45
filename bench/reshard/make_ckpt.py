"""Writes a synthetic Megatron torch_dist checkpoint of about --gb GB (llama or deepseek_v3 shapes,
bf16, TP=2 x PP=2 chunking, EP=2 for experts) with PyTorch's distributed checkpoint writer, in one
gloo process."""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "reshard"))
import megatron_fixture as mf  # noqa: E402  (installs the torch 1.13 import fix)
import torch  # noqa: E402


def config(gb):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
           "num_attention_heads": 16, "num_key_value_heads": 4, "intermediate_size": 5632,
           "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    per_layer = 2 * (24 * 128 * 2048 + 16 * 128 * 2048 + 3 * 5632 * 2048 + 2 * 2048)
    fixed = 2 * (2 * 32256 * 2048 + 2048)
    layers = max(2, round((gb * 1e9 - fixed) / per_layer / 2) * 2)
    cfg["num_hidden_layers"] = layers
    return cfg


def deepseek_config(gb):
    """DeepSeek-V3-like (MLA, 32 routed + 1 shared expert, first layer dense) at hidden 2048."""
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
           "q_lora_rank": 512, "kv_lora_rank": 256, "qk_nope_head_dim": 64,
           "qk_rope_head_dim": 32, "v_head_dim": 64, "intermediate_size": 5632,
           "moe_intermediate_size": 512, "n_routed_experts": 32, "n_shared_experts": 1,
           "num_experts_per_tok": 8, "first_k_dense_replace": 1, "moe_layer_freq": 1,
           "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    h = 2048
    attn = 512 * h + 16 * 96 * 512 + 288 * h + 16 * 128 * 256 + h * 16 * 64
    dense = 2 * (attn + 3 * 5632 * h)
    moe = 2 * (attn + 33 * 3 * 512 * h + 32 * h)
    fixed = 2 * (2 * 32256 * h + h)
    layers = 1 + max(1, round((gb * 1e9 - fixed - dense) / moe))
    cfg["num_hidden_layers"] = layers + layers % 2  # PP=2
    return cfg


class _Shape:
    """Stands in for a tensor while collecting the shapes megatron_fixture's generator makes."""

    def __init__(self, shape, dtype=torch.bfloat16):
        self.shape, self.dtype = tuple(shape), dtype

    def float(self):
        return _Shape(self.shape, torch.float32)


def deepseek_shapes(cfg):
    out = {"embedding.word_embeddings.weight": _Shape((32256, 2048)),
           "output_layer.weight": _Shape((32256, 2048)),
           "decoder.final_layernorm.weight": _Shape((2048,))}
    out.update(mf.deepseek_tensors(cfg, lambda *shape: _Shape(shape)))
    return out


def main():
    from torch.distributed._shard.checkpoint import FileSystemWriter, save_state_dict
    from torch.distributed._shard.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                  TensorProperties)
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama", choices=["llama", "deepseek_v3"])
    args = ap.parse_args()
    import torch.distributed as dist

    # ShardedTensor wants a process group even with one process (loopback only).
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{mf.free_port()}", rank=0,
                            world_size=1)
    cfg = config(args.gb) if args.model == "llama" else deepseek_config(args.gb)
    L, h, ffn = cfg["num_hidden_layers"], 2048, 5632
    shapes = deepseek_shapes(cfg) if args.model == "deepseek_v3" else {
        "embedding.word_embeddings.weight": (32256, h),
        "output_layer.weight": (32256, h),
        "decoder.final_layernorm.weight": (h,),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, h),
        "decoder.layers.self_attention.linear_qkv.weight": (L, 24 * 128, h),
        "decoder.layers.self_attention.linear_proj.weight": (L, h, 16 * 128),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, h),
        "decoder.layers.mlp.linear_fc1.weight": (L, 2 * ffn, h),
        "decoder.layers.mlp.linear_fc2.weight": (L, h, ffn),
    }
    state = {}
    for key, shape in shapes.items():
        dtype = torch.bfloat16
        if isinstance(shape, _Shape):
            shape, dtype = shape.shape, shape.dtype
        chunks = mf.chunks_for(key, shape, 2, 2, L)
        metas = [ShardMetadata(o, s, "rank:0/cpu") for _, o, s in chunks]
        local = []
        for m in metas:
            n = 1
            for s in m.shard_sizes:
                n *= s
            # Untouched memory: the planner below makes the data when the chunk is written.
            local.append(Shard(torch.empty(m.shard_sizes, dtype=dtype), m))
        st_meta = ShardedTensorMetadata(metas, torch.Size(shape),
                                        TensorProperties(dtype=dtype))
        state[key] = ShardedTensor._init_from_local_shards_and_global_metadata(
            local, st_meta, sharding_spec=EnumerableShardingSpec(metas))
    class LazyPlanner(DefaultSavePlanner):
        """Makes each chunk's data as it is written, so that memory holds one chunk at a time
        whatever the checkpoint's size (a 16 GB one fits on a machine with less free RAM)."""

        def resolve_data(self, write_item):
            obj = self.lookup_object(write_item.index)
            if not isinstance(obj, torch.Tensor):
                return super().resolve_data(write_item)
            return (torch.arange(obj.numel(), dtype=torch.int32) % 251).to(obj.dtype).reshape(
                obj.shape)

    save_state_dict(state, FileSystemWriter(args.out, single_file_per_rank=True),
                    planner=LazyPlanner())
    hf = args.out + "-hf-config"
    os.makedirs(hf, exist_ok=True)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


if __name__ == "__main__":
    main()
