"""bragg_pack: THD packing, cost-aware balancing and zigzag context-parallel partitioning.

Planning is done in C++ (``bragg_pack._core``, GIL released); the helpers here move per-token
numpy arrays between the real-token layout, the padded THD row and the CP-local layout. Every
helper takes arrays whose first dimension is tokens, so the same call serves tokens, labels,
loss masks, position ids, log-probs, advantages and routed experts ``[T, layers, top_k]``.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from ._core import (  # noqa: F401  (re-exported)
    Plan,
    alignment,
    cost_model_from_model_size,
    cp_indices,
    fit_cost_model,
    plan,
    row_alignment,
)

__all__ = [
    "Plan",
    "alignment",
    "cost_model_from_model_size",
    "cp_indices",
    "fit_cost_model",
    "plan",
    "row_alignment",
    "partition",
    "restore",
    "pack_to_padded",
    "unpack_from_padded",
    "shift_within_traces",
    "packed_seq_params_kwargs",
]


def _check_cu(cu_seqlens, cu_seqlens_padded):
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    cup = np.asarray(cu_seqlens_padded, dtype=np.int64)
    if cu.ndim != 1 or cup.shape != cu.shape or cu.size == 0 or cu[0] != 0 or cup[0] != 0:
        raise ValueError("cu_seqlens and cu_seqlens_padded must be 1-D, equal length, from 0")
    lens, plens = np.diff(cu), np.diff(cup)
    if (lens < 0).any() or (lens > plens).any():
        raise ValueError("each trace needs 0 <= real length <= padded length")
    return cu, cup


def partition(array: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """This CP rank's tokens of a padded row: ``array[indices]`` along the token axis."""
    array = np.asarray(array)
    indices = np.asarray(indices)
    if indices.size and (indices.min() < 0 or indices.max() >= array.shape[0]):
        raise ValueError("CP index out of range for an array of %d tokens" % array.shape[0])
    return np.take(array, indices, axis=0)


def restore(parts: Sequence[np.ndarray], indices: Sequence[np.ndarray], total_tokens: int):
    """Inverse of partition over all CP ranks: reassembles the padded row exactly."""
    if len(parts) != len(indices) or not parts:
        raise ValueError("need one part per CP rank and its indices")
    first = np.asarray(parts[0])
    out = np.empty((total_tokens,) + first.shape[1:], dtype=first.dtype)
    seen = np.zeros(total_tokens, dtype=bool)
    for part, idx in zip(parts, indices):
        idx = np.asarray(idx)
        if len(part) != len(idx):
            raise ValueError("a part and its indices differ in length")
        out[idx] = part
        seen[idx] = True
    if not seen.all():
        raise ValueError("the CP indices do not cover the row")
    return out


def pack_to_padded(values, cu_seqlens, cu_seqlens_padded, fill=0) -> np.ndarray:
    """Real-token rows (concatenated traces) -> padded THD row; padding gets ``fill``.

    Routed-expert rows recorded per real token must go through this: copied contiguously they
    would be shifted by the padding of every earlier trace.
    """
    values = np.asarray(values)
    cu, cup = _check_cu(cu_seqlens, cu_seqlens_padded)
    if values.shape[0] != cu[-1]:
        raise ValueError("values have %d tokens, cu_seqlens says %d" % (values.shape[0], cu[-1]))
    out = np.full((int(cup[-1]),) + values.shape[1:], fill, dtype=values.dtype)
    for k in range(len(cu) - 1):
        n = cu[k + 1] - cu[k]
        out[cup[k]:cup[k] + n] = values[cu[k]:cu[k + 1]]
    return out


def unpack_from_padded(padded, cu_seqlens, cu_seqlens_padded) -> np.ndarray:
    """Inverse of pack_to_padded: drops the padding."""
    padded = np.asarray(padded)
    cu, cup = _check_cu(cu_seqlens, cu_seqlens_padded)
    if padded.shape[0] != cup[-1]:
        raise ValueError("array has %d tokens, cu_seqlens_padded says %d" % (padded.shape[0], cup[-1]))
    parts = [padded[cup[k]:cup[k] + (cu[k + 1] - cu[k])] for k in range(len(cu) - 1)]
    if not parts:
        return padded[:0]
    return np.concatenate(parts, axis=0)


def shift_within_traces(padded, cu_seqlens, cu_seqlens_padded, fill) -> np.ndarray:
    """out[j] = in[j+1] inside each trace; the last real token and padding get ``fill``.

    labels = shift_within_traces(tokens, ..., -100); loss_mask = shift_within_traces(mask, ..., 0).
    Call before CP partitioning so no label crosses into the next trace.
    """
    padded = np.asarray(padded)
    cu, cup = _check_cu(cu_seqlens, cu_seqlens_padded)
    if padded.shape[0] != cup[-1]:
        raise ValueError("array has %d tokens, cu_seqlens_padded says %d" % (padded.shape[0], cup[-1]))
    out = np.full_like(padded, fill)
    for k in range(len(cu) - 1):
        n = cu[k + 1] - cu[k]
        if n >= 2:
            out[cup[k]:cup[k] + n - 1] = padded[cup[k] + 1:cup[k] + n]
    return out


def packed_seq_params_kwargs(micro_batch: Dict[str, np.ndarray]) -> Dict[str, object]:
    """Keyword arguments for Megatron-LM's ``PackedSeqParams(**kwargs)`` (qkv_format="thd").

    Arrays are numpy int32; move them to the GPU with ``torch.from_numpy(a).cuda()``. The
    cu_seqlens are for the whole packed row on every CP rank (TransformerEngine partitions
    internally); the tokens themselves go through ``partition(x, cp_indices(...))``.
    """
    cu = np.ascontiguousarray(micro_batch["cu_seqlens"], dtype=np.int32)
    cup = np.ascontiguousarray(micro_batch["cu_seqlens_padded"], dtype=np.int32)
    max_seqlen = int(micro_batch["max_seqlen"])
    return {
        "qkv_format": "thd",
        "cu_seqlens_q": cu,
        "cu_seqlens_kv": cu,
        "cu_seqlens_q_padded": cup,
        "cu_seqlens_kv_padded": cup,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen,
    }
