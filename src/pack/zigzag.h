#pragma once

// Zigzag context-parallel (CP) partitioning of one packed THD row, and the helpers that move
// per-token arrays between the real-token layout, the padded row layout and the CP-local layout.
//
// For CP rank r of cp, each trace's padded span [cu_seqlens_padded[k], cu_seqlens_padded[k+1])
// is cut into 2*cp equal chunks and rank r takes chunks r and 2*cp-1-r, in that order, trace
// after trace: the same indices as TransformerEngine's thd_get_partitioned_indices. Pairing an
// early chunk with a late one gives every rank the same causal-attention work.
//
// All functions are pure and thread-safe; arrays are row-major with a leading token dimension
// and `inner` elements per token (e.g. layers*top_k for routed experts [T, layers, top_k]).

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"

namespace bragg::pack {

// Checks that `cu` is a valid cumulative-length vector: at least one entry, starts at 0,
// non-decreasing. InvalidArgument otherwise, naming the offending position.
Status ValidateCuSeqlens(std::span<const int32_t> cu);

// Token indices (into the padded row) owned by CP rank `rank`. Errors: InvalidArgument when
// cp < 1, rank outside [0, cp), cu_seqlens_padded invalid, or a padded length not divisible by
// 2*cp when cp > 1 (never rounded: pad traces with Alignment() first). cp == 1 gives all
// tokens in order.
Result<std::vector<int32_t>> CpIndices(std::span<const int32_t> cu_seqlens_padded, int cp,
                                       int rank);

// out[i] = src[indices[i]] for every token (inner elements each). Errors: InvalidArgument when
// src.size() is not a multiple of inner or an index is out of range.
template <typename T>
Result<std::vector<T>> GatherTokens(std::span<const T> src, size_t inner,
                                    std::span<const int32_t> indices);

// Inverse of GatherTokens: dst[indices[i]] = part[i]. `dst` must already have its full size.
// Errors as GatherTokens, plus a size mismatch between part and indices.
template <typename T>
Status ScatterTokens(std::span<const T> part, size_t inner, std::span<const int32_t> indices,
                     std::span<T> dst);

// Places real-token values (sum of real lengths tokens, in trace order) at their padded
// offsets; padding tokens get `fill`. This is where routed-expert rows must go: copying them
// contiguously would shift every trace after the first by the padding before it.
template <typename T>
Result<std::vector<T>> PackToPadded(std::span<const T> real, size_t inner,
                                    std::span<const int32_t> cu_seqlens,
                                    std::span<const int32_t> cu_seqlens_padded, T fill);

// Inverse of PackToPadded: drops the padding.
template <typename T>
Result<std::vector<T>> UnpackFromPadded(std::span<const T> padded, size_t inner,
                                        std::span<const int32_t> cu_seqlens,
                                        std::span<const int32_t> cu_seqlens_padded);

// Shifts values left by one token within each trace of a padded row: out[j] = in[j+1] for the
// first length-1 tokens of a trace, `fill` for its last real token and its padding. Labels are
// ShiftWithinTraces(tokens, ..., ignore_index); loss masks ShiftWithinTraces(mask, ..., 0), so
// the last token of every trace has loss mask 0 and no label crosses into the next trace.
// Call it before CP partitioning.
template <typename T>
Result<std::vector<T>> ShiftWithinTraces(std::span<const T> padded, size_t inner,
                                         std::span<const int32_t> cu_seqlens,
                                         std::span<const int32_t> cu_seqlens_padded, T fill);

}  // namespace bragg::pack

#include "pack/zigzag_inl.h"  // IWYU pragma: export
