#pragma once

// Template definitions for zigzag.h. Include zigzag.h, not this file.

#include <algorithm>
#include <string>

#include "fmt/format.h"
#include "pack/zigzag.h"

namespace bragg::pack {
namespace zigzag_internal {

// Checks that cu_seqlens (real) and cu_seqlens_padded describe the same traces with real
// length <= padded length.
Status ValidatePair(std::span<const int32_t> cu, std::span<const int32_t> cu_padded);

}  // namespace zigzag_internal

template <typename T>
Result<std::vector<T>> GatherTokens(std::span<const T> src, size_t inner,
                                    std::span<const int32_t> indices) {
  if (inner == 0 || src.size() % inner != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "array of {} elements is not a whole number of tokens of {} elements", src.size(), inner));
  }
  const size_t tokens = src.size() / inner;
  std::vector<T> out(indices.size() * inner);
  for (size_t i = 0; i < indices.size(); ++i) {
    const int32_t t = indices[i];
    if (t < 0 || static_cast<size_t>(t) >= tokens) {
      return absl::InvalidArgumentError(
          fmt::format("index {} at position {} is outside the {} tokens", t, i, tokens));
    }
    std::copy_n(src.data() + static_cast<size_t>(t) * inner, inner, out.data() + i * inner);
  }
  return out;
}

template <typename T>
Status ScatterTokens(std::span<const T> part, size_t inner, std::span<const int32_t> indices,
                     std::span<T> dst) {
  if (inner == 0 || dst.size() % inner != 0 || part.size() != indices.size() * inner) {
    return absl::InvalidArgumentError(
        fmt::format("scatter of {} elements with {} indices of {} elements into {} elements",
                    part.size(), indices.size(), inner, dst.size()));
  }
  const size_t tokens = dst.size() / inner;
  for (size_t i = 0; i < indices.size(); ++i) {
    const int32_t t = indices[i];
    if (t < 0 || static_cast<size_t>(t) >= tokens) {
      return absl::InvalidArgumentError(
          fmt::format("index {} at position {} is outside the {} tokens", t, i, tokens));
    }
    std::copy_n(part.data() + i * inner, inner, dst.data() + static_cast<size_t>(t) * inner);
  }
  return absl::OkStatus();
}

template <typename T>
Result<std::vector<T>> PackToPadded(std::span<const T> real, size_t inner,
                                    std::span<const int32_t> cu_seqlens,
                                    std::span<const int32_t> cu_seqlens_padded, T fill) {
  BRAGG_RETURN_IF_ERROR(zigzag_internal::ValidatePair(cu_seqlens, cu_seqlens_padded));
  if (inner == 0 || real.size() != static_cast<size_t>(cu_seqlens.back()) * inner) {
    return absl::InvalidArgumentError(fmt::format(
        "real-token array has {} elements, want cu_seqlens[-1]={} tokens of {} elements",
        real.size(), cu_seqlens.back(), inner));
  }
  std::vector<T> out(static_cast<size_t>(cu_seqlens_padded.back()) * inner, fill);
  for (size_t k = 0; k + 1 < cu_seqlens.size(); ++k) {
    const size_t n = static_cast<size_t>(cu_seqlens[k + 1] - cu_seqlens[k]) * inner;
    std::copy_n(real.data() + static_cast<size_t>(cu_seqlens[k]) * inner, n,
                out.data() + static_cast<size_t>(cu_seqlens_padded[k]) * inner);
  }
  return out;
}

template <typename T>
Result<std::vector<T>> UnpackFromPadded(std::span<const T> padded, size_t inner,
                                        std::span<const int32_t> cu_seqlens,
                                        std::span<const int32_t> cu_seqlens_padded) {
  BRAGG_RETURN_IF_ERROR(zigzag_internal::ValidatePair(cu_seqlens, cu_seqlens_padded));
  if (inner == 0 || padded.size() != static_cast<size_t>(cu_seqlens_padded.back()) * inner) {
    return absl::InvalidArgumentError(fmt::format(
        "padded array has {} elements, want cu_seqlens_padded[-1]={} tokens of {} elements",
        padded.size(), cu_seqlens_padded.back(), inner));
  }
  std::vector<T> out(static_cast<size_t>(cu_seqlens.back()) * inner);
  for (size_t k = 0; k + 1 < cu_seqlens.size(); ++k) {
    const size_t n = static_cast<size_t>(cu_seqlens[k + 1] - cu_seqlens[k]) * inner;
    std::copy_n(padded.data() + static_cast<size_t>(cu_seqlens_padded[k]) * inner, n,
                out.data() + static_cast<size_t>(cu_seqlens[k]) * inner);
  }
  return out;
}

template <typename T>
Result<std::vector<T>> ShiftWithinTraces(std::span<const T> padded, size_t inner,
                                         std::span<const int32_t> cu_seqlens,
                                         std::span<const int32_t> cu_seqlens_padded, T fill) {
  BRAGG_RETURN_IF_ERROR(zigzag_internal::ValidatePair(cu_seqlens, cu_seqlens_padded));
  if (inner == 0 || padded.size() != static_cast<size_t>(cu_seqlens_padded.back()) * inner) {
    return absl::InvalidArgumentError(fmt::format(
        "padded array has {} elements, want cu_seqlens_padded[-1]={} tokens of {} elements",
        padded.size(), cu_seqlens_padded.back(), inner));
  }
  std::vector<T> out(padded.size(), fill);
  for (size_t k = 0; k + 1 < cu_seqlens.size(); ++k) {
    const size_t len = static_cast<size_t>(cu_seqlens[k + 1] - cu_seqlens[k]);
    if (len < 2) {
      continue;
    }
    const size_t start = static_cast<size_t>(cu_seqlens_padded[k]) * inner;
    std::copy_n(padded.data() + start + inner, (len - 1) * inner, out.data() + start);
  }
  return out;
}

}  // namespace bragg::pack
