"""bragg_rl.megatron against megatron-core itself (on CPU): PackedSeqParams built by the adapter
compared with megatron-core's class and with what megatron.core.utils.get_thd_batch_on_this_cp_rank
builds from the same row; position ids checked through megatron-core's own THD rotary embedding;
labels, loss mask, advantages and log-probs of a hand-computed three-sequence row, unpadded and
padded for CP=2; read_batches; hostile rows.

Run by ctest (rl_megatron_adapter_test) under the Python peer environment (python/peers.lock),
with PYTHONPATH=<build>/python.
"""

import json
import math

import pytest
import torch

from megatron.core.models.common.embeddings import rope_utils
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.utils import get_thd_batch_on_this_cp_rank

from bragg_rl import megatron as bm

# Three sequences of 3, 5 and 2 tokens: prompt tokens have loss mask 0.
TOKENS = [11, 12, 13, 21, 22, 23, 24, 25, 31, 32]
CU = [0, 3, 8, 10]
LOSS_MASK = [0, 1, 1, 0, 0, 1, 1, 1, 0, 1]
ADVANTAGES = [0.5] * 3 + [-1.0] * 5 + [2.0] * 2
LOGPROBS = [0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5, 0.0, -0.6]
F = 0  # label_fill's default

# Padded for CP=2 (every span a multiple of 2*cp = 4): spans 4, 8, 4.
CU_PADDED = [0, 4, 12, 16]
PAD = 7


def row(**changes):
    r = {"tokens": list(TOKENS), "cu_seqlens": list(CU), "loss_mask": list(LOSS_MASK),
         "advantages": list(ADVANTAGES), "logprobs": list(LOGPROBS)}
    r.update(changes)
    return r


def padded_row():
    return bm.pad_row(row(), 4, pad_token_id=PAD)


def as_list(t):
    return t.squeeze(0).tolist()


def test_packed_seq_params_is_megatrons_class_with_the_fields_computed_by_hand():
    p = bm.packed_seq_params(row())
    assert type(p) is PackedSeqParams
    assert p.qkv_format == "thd"
    for t in (p.cu_seqlens_q, p.cu_seqlens_kv):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.dim() == 1
        assert t.tolist() == CU
    assert p.cu_seqlens_q_padded is None and p.cu_seqlens_kv_padded is None
    assert p.max_seqlen_q == p.max_seqlen_kv == 5
    assert isinstance(p.max_seqlen_q, int)


def test_padded_for_cp2():
    r = padded_row()
    assert r["cu_seqlens_padded"].tolist() == CU_PADDED
    assert r["cu_seqlens"].tolist() == CU
    assert r["tokens"].tolist() == [11, 12, 13, PAD, 21, 22, 23, 24, 25, PAD, PAD, PAD,
                                    31, 32, PAD, PAD]
    p = bm.packed_seq_params(r, cp_size=2)
    assert type(p) is PackedSeqParams
    assert p.cu_seqlens_q.tolist() == CU and p.cu_seqlens_kv.tolist() == CU
    assert p.cu_seqlens_q_padded.dtype == torch.int32
    assert p.cu_seqlens_q_padded.tolist() == CU_PADDED
    assert p.cu_seqlens_kv_padded.tolist() == CU_PADDED
    assert p.max_seqlen_q == p.max_seqlen_kv == 8  # the longest padded span
    # Re-padding a padded row starts from its real tokens: same spans.
    assert bm.pad_row(r, 4)["cu_seqlens_padded"].tolist() == CU_PADDED
    assert bm.pad_row(r, 1)["cu_seqlens_padded"].tolist() == CU


def test_same_params_as_megatrons_own_thd_batch_code():
    batch, ours = bm.megatron_batch(padded_row(), cp_size=2)
    # Megatron's get_thd_batch_on_this_cp_rank builds PackedSeqParams from the batch's
    # cu_seqlens, cu_seqlens_padded and max_seqlen; at cp_size 1 it needs no TransformerEngine.
    sliced, theirs = get_thd_batch_on_this_cp_rank(
        dict(batch), batch["cu_seqlens"], batch["cu_seqlens_padded"], batch["max_seqlen"],
        cp_size=1, cp_rank=0)
    for field in ("qkv_format", "max_seqlen_q", "max_seqlen_kv"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                  "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    assert torch.equal(sliced["tokens"], batch["tokens"])


def test_batch_for_the_example():
    batch, params = bm.megatron_batch(row())
    for key in ("tokens", "position_ids", "labels", "loss_mask", "advantages", "old_logprobs"):
        assert batch[key].shape == (1, 10), key
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert batch["position_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.float32
    assert as_list(batch["tokens"]) == TOKENS
    assert as_list(batch["position_ids"]) == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert as_list(batch["labels"]) == [12, 13, F, 22, 23, 24, 25, F, 32, F]
    assert as_list(batch["loss_mask"]) == [1, 1, 0, 0, 1, 1, 1, 0, 1, 0]
    assert as_list(batch["advantages"]) == [0.5, 0.5, 0, 0, -1, -1, -1, 0, 2, 0]
    assert as_list(batch["old_logprobs"]) == pytest.approx(
        [-0.1, -0.2, 0, 0, -0.3, -0.4, -0.5, 0, -0.6, 0])
    assert batch["cu_seqlens"].tolist() == CU and batch["max_seqlen"].tolist() == [5]
    assert params.cu_seqlens_q.tolist() == CU


def test_batch_for_the_padded_example():
    batch, _ = bm.megatron_batch(padded_row(), cp_size=2, label_fill=-100)
    assert batch["tokens"].shape == (1, 16)
    assert as_list(batch["position_ids"]) == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    x = -100
    assert as_list(batch["labels"]) == [12, 13, x, x, 22, 23, 24, 25, x, x, x, x, 32, x, x, x]
    assert as_list(batch["loss_mask"]) == [1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0]
    assert as_list(batch["advantages"]) == [0.5, 0.5, 0, 0, 0, -1, -1, -1, 0, 0, 0, 0,
                                            2, 0, 0, 0]
    assert batch["cu_seqlens_padded"].tolist() == CU_PADDED
    assert batch["max_seqlen"].tolist() == [8]
    # Every label under the loss mask is the next token of the same sequence.
    toks, labels, mask = (as_list(batch[k]) for k in ("tokens", "labels", "loss_mask"))
    for j, m in enumerate(mask):
        if m:
            assert labels[j] == toks[j + 1]


class _OneRank:
    """The size()/rank() of a context-parallel group of one, for megatron's THD RoPE."""

    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.mark.parametrize("padded", [False, True])
def test_position_ids_match_megatrons_thd_rotary_embedding(padded):
    # Megatron's attention rotates queries and keys of a THD row per sequence, from
    # cu_seqlens_q_padded when set, else cu_seqlens_q (megatron/core/transformer/attention.py).
    # Rotating each token by its position id must give the same tensor.
    batch, params = bm.megatron_batch(padded_row() if padded else row(), cp_size=1)
    cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None \
        else params.cu_seqlens_q
    total, heads, dim = batch["tokens"].shape[1], 2, 8
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    theta = torch.arange(params.max_seqlen_q, dtype=torch.float64)[:, None] * inv_freq
    freqs = torch.cat([theta, theta], dim=-1)[:, None, None, :]  # [max_s, 1, 1, dim]
    theirs = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_OneRank())
    ours = rope_utils._apply_rotary_pos_emb_bshd(
        t[:, None], freqs[batch["position_ids"][0]]).squeeze(1)
    assert torch.allclose(theirs, ours, atol=1e-12)
    assert not torch.allclose(theirs, t)  # the rotation did something


def test_read_batches(tmp_path):
    path = tmp_path / "batches.jsonl"
    p = padded_row()
    with open(path, "w") as f:
        f.write(json.dumps(dict(row(), trace_ids=[4, 9, 2], version=3)) + "\n\n")
        f.write(json.dumps({k: (v.tolist() if hasattr(v, "tolist") else v)
                            for k, v in p.items() if k != "padded"}) + "\n")
    rows = list(bm.read_batches(str(path)))
    assert len(rows) == 2
    assert rows[0]["trace_ids"] == [4, 9, 2] and rows[0]["version"] == 3
    assert rows[0]["tokens"].tolist() == TOKENS and not rows[0]["padded"]
    assert rows[1]["padded"] and rows[1]["cu_seqlens_padded"].tolist() == CU_PADDED
    batch, params = bm.megatron_batch(rows[1], cp_size=2)
    assert params.cu_seqlens_kv_padded.tolist() == CU_PADDED
    assert batch["tokens"].shape == (1, 16)


def test_read_batches_rejects_bad_files(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_text(json.dumps(row()) + "\n" + json.dumps(row())[:40])
    rows = bm.read_batches(str(path))
    assert next(rows)["tokens"].tolist() == TOKENS
    with pytest.raises(ValueError, match=r"cut.jsonl:2: not a JSON object.*truncated last line"):
        next(rows)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(loss_mask=[1] * 9)) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: loss_mask has 9 entries but the row "
                                         r"has 10 tokens"):
        list(bm.read_batches(str(path)))
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a packed row is a JSON object"):
        list(bm.read_batches(str(path)))
    with pytest.raises(OSError):
        list(bm.read_batches(str(tmp_path / "missing.jsonl")))


@pytest.mark.parametrize("changes, message", [
    ({"cu_seqlens": [0, 3, 3, 10]}, r"cu_seqlens must strictly increase.*cu_seqlens\[1\]=3, "
                                    r"cu_seqlens\[2\]=3"),
    ({"cu_seqlens": [0, 8, 3, 10]}, r"cu_seqlens must strictly increase"),
    ({"cu_seqlens": [1, 3, 8, 10]}, r"cu_seqlens must start at 0"),
    ({"cu_seqlens": [0]}, r"at least one sequence"),
    ({"cu_seqlens": [0, 3, 8, 12]}, r"the row has 10 tokens but cu_seqlens ends at 12: the "
                                    r"sequence lengths must add up"),
    ({"cu_seqlens": [0, 3, 8]}, r"the row has 10 tokens but cu_seqlens ends at 8"),
    ({"loss_mask": [0, 1, 1]}, r"loss_mask has 3 entries but the row has 10 tokens"),
    ({"advantages": [0.0] * 11}, r"advantages has 11 entries"),
    ({"logprobs": []}, r"logprobs has 0 entries"),
    ({"loss_mask": [2] * 10}, r"loss_mask must be 0 or 1"),
    ({"tokens": [-1] + TOKENS[1:]}, r"token ids must be >= 0"),
    ({"tokens": [1.5] * 10}, r"tokens must hold integers"),
    ({"tokens": [[1, 2]] * 10}, r"tokens must be a 1-D list"),
    ({"advantages": [math.nan] * 10}, r"advantages is NaN or infinite on a loss token "
                                      r"\(position 1\)"),
    ({"cu_seqlens_padded": [0, 2, 12, 16]}, r"sequence 0 is 3 tokens long but its padded span "
                                            r"holds 2"),
    ({"cu_seqlens_padded": [0, 4, 16]}, r"cu_seqlens_padded has 3 entries, cu_seqlens 4"),
    ({"cu_seqlens_padded": [0, 4, 12, 16]}, r"the row has 10 tokens but cu_seqlens_padded "
                                            r"ends at 16"),
])
def test_hostile_rows_raise_clear_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        bm.megatron_batch(row(**changes))
    with pytest.raises(ValueError, match=message):
        bm.packed_seq_params(row(**changes))


def test_missing_keys_and_bad_arguments():
    r = row()
    del r["logprobs"]
    with pytest.raises(ValueError, match="missing logprobs"):
        bm.check_row(r)
    with pytest.raises(ValueError, match=r"cp_size=2\) needs a padded row.*pad_row\(row, 4\)"):
        bm.packed_seq_params(row(), cp_size=2)
    with pytest.raises(ValueError, match=r"with cp_size=2 every padded span must be a multiple "
                                         r"of 4.*sequence 1 spans 6 tokens"):
        bm.megatron_batch(bm.pad_row(row(), 2), cp_size=2)
    with pytest.raises(ValueError, match="cp_size must be a positive integer"):
        bm.packed_seq_params(row(), cp_size=0)
    with pytest.raises(ValueError, match="multiple must be a positive integer"):
        bm.pad_row(row(), 0)
    with pytest.raises(ValueError, match="label_fill must be an integer"):
        bm.megatron_batch(row(), label_fill=0.5)


def test_off_loss_values_are_zeroed_and_inputs_are_not_changed():
    # Prompt log-probs a writer left as -inf or NaN must not reach the loss: 0 * -inf is NaN.
    logprobs = [-math.inf, -0.1, -0.2, math.nan, math.nan, -0.3, -0.4, -0.5, -math.inf, -0.6]
    r = row(logprobs=logprobs)
    batch, _ = bm.megatron_batch(r)
    assert torch.isfinite(batch["old_logprobs"]).all()
    assert as_list(batch["old_logprobs"]) == pytest.approx(
        [-0.1, -0.2, 0, 0, -0.3, -0.4, -0.5, 0, -0.6, 0])
    assert r["logprobs"] is logprobs and math.isinf(logprobs[0])


def test_tensor_and_numpy_inputs():
    import numpy as np
    r = {"tokens": torch.tensor(TOKENS), "cu_seqlens": np.array(CU, dtype=np.int32),
         "loss_mask": torch.tensor(LOSS_MASK, dtype=torch.bool),
         "advantages": np.array(ADVANTAGES, dtype=np.float32),
         "logprobs": torch.tensor(LOGPROBS)}
    batch, params = bm.megatron_batch(r)
    assert as_list(batch["labels"]) == [12, 13, F, 22, 23, 24, 25, F, 32, F]
    assert params.cu_seqlens_q.tolist() == CU
