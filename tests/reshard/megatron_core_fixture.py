"""Megatron-core's own checkpoints of Hugging Face models, for bragg-reshard's interop test.

Runs under the Python peer environment (python/peers.lock: torch 2.x, transformers,
megatron-core), never Debian's torch. For each family (llama, qwen3, qwen3_moe):

1. transformers builds a small model from a seeded random init: the source weights. Rank 0 saves
   it with save_pretrained as DIR/<family>-src (config.json + safetensors).
2. Every rank builds megatron-core's GPTModel (local layer spec, CPU, gloo) at TP 1 x PP 1 and
   loads the source weights into it (hf_to_megatron below: the only mapping written here).
   Rank 0 runs megatron-core's forward on fixed tokens and compares its logits with transformers'
   on the source model: this checks hf_to_megatron against megatron-core's own reading of its
   weights, so that the mapping bragg-reshard inverts is not ours alone. The four ranks then save
   with megatron-core's dist_checkpointing.save (DIR/<family>-tp1, data parallel 4).
3. The ranks rebuild the model at TP 2 x PP 2 (EP 2 x PP 2 for MoE), load DIR/<family>-tp1 with
   dist_checkpointing.load (megatron-core's own resharding splits every tensor) and save again:
   DIR/<family> (and, for llama, DIR/<family>-optim with a megatron-core optimizer's state saved
   beside the model, as Megatron-LM's checkpoints have it).

Megatron-core's forward needs CUDA in three places even for CPU tensors (the rotary frequencies'
device, the default causal mask, the CUDA RNG tracker around attention dropout) and its
checkpoint writer calls torch.cuda.synchronize(); cpu_shims() points those at the CPU. Saving and
loading themselves run megatron-core's code unchanged.

Usage: megatron_core_fixture.py --root DIR [--families llama,qwen3,qwen3_moe]
writes DIR/<family>{-src,-tp1,,-optim} and DIR/forward.json (megatron-core's and transformers'
max |logit difference| per family).
"""

import argparse
import contextlib
import json
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FAMILIES = ["llama", "qwen3", "qwen3_moe"]
WORLD = 4
TOKENS = [[3, 17, 42, 99, 5, 64, 7, 120, 11, 2, 77, 31]]


def hf_config(family):
    """A small config per family: GQA (4 query heads, 2 groups), head_dim != hidden/heads for
    the qwen3s, untied embeddings, a vocabulary TP 2 divides."""
    import transformers
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  torch_dtype="float32")
    if family == "llama":
        return transformers.LlamaConfig(**common, head_dim=16, attention_bias=False,
                                        mlp_bias=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=24, attention_bias=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=24, attention_bias=False,
                                           num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[],
                                           output_router_logits=False)
    raise ValueError(family)


def hf_model(family, seed):
    import transformers
    torch.manual_seed(seed)
    cfg = hf_config(family)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    # transformers initialises norms to 1: make them random too, so a swapped norm shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def megatron_config(family, cfg):
    kw = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
              num_attention_heads=cfg.num_attention_heads,
              num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim,
              ffn_hidden_size=cfg.intermediate_size, gated_linear_unit=True,
              activation_func=torch.nn.functional.silu, normalization="RMSNorm",
              layernorm_epsilon=cfg.rms_norm_eps, add_bias_linear=False, add_qkv_bias=False,
              qk_layernorm=family != "llama", use_cpu_initialization=True,
              params_dtype=torch.float32, pipeline_dtype=torch.float32,
              attention_dropout=0.0, hidden_dropout=0.0,
              tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    if family == "qwen3_moe":
        kw.update(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
                  moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_grouped_gemm=False,
                  moe_router_load_balancing_type="none", moe_router_pre_softmax=False,
                  moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
    return kw


def gpt_model(family, cfg, tp, pp, ep=1):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = megatron_config(family, cfg)
    kw.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
              expert_model_parallel_size=ep)
    tcfg = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec(num_experts=kw.get("num_moe_experts"),
                                    moe_grouped_gemm=False, qk_layernorm=family != "llama",
                                    normalization="RMSNorm")
    return GPTModel(config=tcfg, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                    position_embedding_type="rope", rotary_base=int(cfg.rope_theta))


def hf_to_megatron(family, cfg, hf):
    """The source weights under megatron-core's own (TP 1 x PP 1, local spec) parameter names.

    linear_qkv holds, per query group, its query heads, then its key head, then its value head;
    linear_fc1 is [gate; up]; MoE experts are SequentialMLP's local_experts."""
    h = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    heads, groups, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    m = {"embedding.word_embeddings.weight": h["model.embed_tokens.weight"],
         "decoder.final_layernorm.weight": h["model.norm.weight"],
         "output_layer.weight": h["lm_head.weight"]}
    for i in range(cfg.num_hidden_layers):
        s, t = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = h[s + "self_attn.q_proj.weight"].view(groups, heads // groups * d, -1)
        k = h[s + "self_attn.k_proj.weight"].view(groups, d, -1)
        v = h[s + "self_attn.v_proj.weight"].view(groups, d, -1)
        m[t + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(
            -1, cfg.hidden_size)
        m[t + "self_attention.linear_proj.weight"] = h[s + "self_attn.o_proj.weight"]
        m[t + "input_layernorm.weight"] = h[s + "input_layernorm.weight"]
        m[t + "pre_mlp_layernorm.weight"] = h[s + "post_attention_layernorm.weight"]
        if family != "llama":
            m[t + "self_attention.q_layernorm.weight"] = h[s + "self_attn.q_norm.weight"]
            m[t + "self_attention.k_layernorm.weight"] = h[s + "self_attn.k_norm.weight"]
        if family == "qwen3_moe":
            m[t + "mlp.router.weight"] = h[s + "mlp.gate.weight"]
            for e in range(cfg.num_experts):
                x, y = f"{s}mlp.experts.{e}.", f"{t}mlp.experts.local_experts.{e}."
                m[y + "linear_fc1.weight"] = torch.cat(
                    [h[x + "gate_proj.weight"], h[x + "up_proj.weight"]])
                m[y + "linear_fc2.weight"] = h[x + "down_proj.weight"]
        else:
            m[t + "mlp.linear_fc1.weight"] = torch.cat(
                [h[s + "mlp.gate_proj.weight"], h[s + "mlp.up_proj.weight"]])
            m[t + "mlp.linear_fc2.weight"] = h[s + "mlp.down_proj.weight"]
    return m


def load_exactly(model, weights):
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"megatron-core names differ: missing {missing}, "
                           f"unexpected {unexpected}")


def cpu_shims():
    from megatron.core import tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    # Without TransformerEngine, moe_utils never defines te_general_gemm (NameError in the
    # router's gating linear) where it means None.
    moe_utils.te_general_gemm = None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def megatron_logits(model):
    ids = torch.tensor(TOKENS)
    n = ids.shape[1]
    pos = torch.arange(n).unsqueeze(0)
    mask = torch.triu(torch.ones(1, 1, n, n), diagonal=1).bool()
    with torch.no_grad():
        return model(ids, pos, attention_mask=mask)


def optimizer_state_dict(model, model_sd):
    """The optimizer state Megatron-LM saves beside the model, after one Adam step.

    megatron-core's FP32Optimizer puts its loss scale on CUDA in its constructor, so this is
    its sharded_state_dict() spelled out: torch's Adam, then megatron-core's own
    get_param_id_to_sharded_param_map and optim_state_to_sharding_state (exp_avg and exp_avg_sq
    chunked like their parameters, the step as state.common_step)."""
    from megatron.core.dist_checkpointing.optimizer import (get_param_id_to_sharded_param_map,
                                                            optim_state_to_sharding_state)
    params = list(model.parameters())
    # lr 0: the moments fill in but the weights stay the source's (the model's sharded tensors
    # saved beside the optimizer are these very parameters).
    opt = torch.optim.Adam(params, lr=0.0)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    state = opt.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    step = None
    for param_state in state["state"].values():
        step = param_state.pop("step", step)
    optim_state_to_sharding_state(state, id_map, exclude_keys="step")
    state["state"]["common_step"] = step
    return state


def rank_main(rank, root, families, port, seed):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cpu_shims()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    forward = {}
    for family in families:
        hf = hf_model(family, seed)
        cfg = hf.config
        if rank == 0:
            hf.save_pretrained(os.path.join(root, family + "-src"), safe_serialization=True)
        ps.initialize_model_parallel(1, 1)
        model = gpt_model(family, cfg, 1, 1)
        load_exactly(model, hf_to_megatron(family, cfg, hf))
        model.eval()
        if rank == 0:
            with torch.no_grad():
                want = hf(torch.tensor(TOKENS)).logits
            got = megatron_logits(model)
            forward[family] = float((got - want).abs().max())
        tp1 = os.path.join(root, family + "-tp1")
        if rank == 0:
            os.makedirs(tp1)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), tp1)
        ps.destroy_model_parallel()

        # MoE with TP needs sequence parallelism, which the local spec's norms do not support:
        # the MoE family is split the way MoE models are trained, by experts (EP 2 x PP 2).
        tp, ep = (1, 2) if family == "qwen3_moe" else (2, 1)
        ps.initialize_model_parallel(tp, 2, expert_model_parallel_size=ep)
        model = gpt_model(family, cfg, tp, 2, ep)
        state = dist_checkpointing.load(model.sharded_state_dict(), tp1)
        load_exactly(model, state)
        out = os.path.join(root, family)
        if rank == 0:
            os.makedirs(out)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), out)
        if family == "llama":
            sd = {"model": model.sharded_state_dict()}
            sd["optimizer"] = optimizer_state_dict(model, sd["model"])
            optim = os.path.join(root, family + "-optim")
            if rank == 0:
                os.makedirs(optim)
            dist.barrier()
            dist_checkpointing.save(sd, optim)
        ps.destroy_model_parallel()
    if rank == 0:
        with open(os.path.join(root, "forward.json"), "w") as f:
            json.dump(forward, f)
    dist.barrier()
    dist.destroy_process_group()



def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args()
    families = a.families.split(",")
    for f in families:
        if f not in FAMILIES:
            ap.error(f"unknown family {f}: {', '.join(FAMILIES)}")
    torch.set_num_threads(1)
    # A rank that raises makes start_processes raise with its traceback.
    mp.start_processes(rank_main, args=(a.root, families, free_port(), a.seed), nprocs=WORLD,
                       join=True, start_method="spawn")


if __name__ == "__main__":
    main()
