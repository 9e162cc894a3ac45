"""The torch reference converter on a checkpoint (whole tensors in RAM), for timing.
Usage: reference_convert.py CKPT HF_CONFIG_DIR OUT [FAMILY (default llama)]"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests",
                                "reshard"))
import megatron_fixture as mf  # noqa: E402
import torch  # noqa: E402

ckpt, cfg_dir, out = sys.argv[1:4]
family = sys.argv[4] if len(sys.argv) > 4 else "llama"
with open(os.path.join(cfg_dir, "config.json")) as f:
    cfg = json.load(f)
torch.save(mf.reference(ckpt, cfg, family), out)
