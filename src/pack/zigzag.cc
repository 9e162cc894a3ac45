#include "pack/zigzag.h"

#include "fmt/format.h"

namespace bragg::pack {

Status ValidateCuSeqlens(std::span<const int32_t> cu) {
  if (cu.empty()) {
    return absl::InvalidArgumentError("cu_seqlens is empty; it needs at least the leading 0");
  }
  if (cu[0] != 0) {
    return absl::InvalidArgumentError(fmt::format("cu_seqlens starts at {}, not 0", cu[0]));
  }
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1]) {
      return absl::InvalidArgumentError(
          fmt::format("cu_seqlens decreases at position {} ({} after {})", i, cu[i], cu[i - 1]));
    }
  }
  return absl::OkStatus();
}

namespace zigzag_internal {

Status ValidatePair(std::span<const int32_t> cu, std::span<const int32_t> cu_padded) {
  BRAGG_RETURN_IF_ERROR(ValidateCuSeqlens(cu));
  BRAGG_RETURN_IF_ERROR(ValidateCuSeqlens(cu_padded));
  if (cu.size() != cu_padded.size()) {
    return absl::InvalidArgumentError(fmt::format(
        "cu_seqlens has {} entries but cu_seqlens_padded has {}", cu.size(), cu_padded.size()));
  }
  for (size_t k = 0; k + 1 < cu.size(); ++k) {
    if (cu[k + 1] - cu[k] > cu_padded[k + 1] - cu_padded[k]) {
      return absl::InvalidArgumentError(
          fmt::format("trace {} has {} real tokens but a padded span of {}", k, cu[k + 1] - cu[k],
                      cu_padded[k + 1] - cu_padded[k]));
    }
  }
  return absl::OkStatus();
}

}  // namespace zigzag_internal

Result<std::vector<int32_t>> CpIndices(std::span<const int32_t> cu_seqlens_padded, int cp,
                                       int rank) {
  if (cp < 1 || rank < 0 || rank >= cp) {
    return absl::InvalidArgumentError(
        fmt::format("CP rank {} of size {}: need cp >= 1 and 0 <= rank < cp", rank, cp));
  }
  BRAGG_RETURN_IF_ERROR(ValidateCuSeqlens(cu_seqlens_padded));
  if (cp == 1) {
    // No CP: the rank owns the row as it is; nothing needs to divide.
    std::vector<int32_t> all(static_cast<size_t>(cu_seqlens_padded.back()));
    for (size_t i = 0; i < all.size(); ++i) {
      all[i] = static_cast<int32_t>(i);
    }
    return all;
  }
  const int64_t parts = 2 * static_cast<int64_t>(cp);
  for (size_t k = 0; k + 1 < cu_seqlens_padded.size(); ++k) {
    const int64_t len = cu_seqlens_padded[k + 1] - cu_seqlens_padded[k];
    if (len % parts != 0) {
      return absl::InvalidArgumentError(fmt::format(
          "trace {} has padded length {}, not a multiple of 2*cp={}; pad every trace to the "
          "plan's alignment instead of rounding",
          k, len, parts));
    }
  }
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(cu_seqlens_padded.back() / cp));
  for (size_t k = 0; k + 1 < cu_seqlens_padded.size(); ++k) {
    const int32_t start = cu_seqlens_padded[k];
    const int32_t chunk = static_cast<int32_t>((cu_seqlens_padded[k + 1] - start) / parts);
    for (int64_t c : {static_cast<int64_t>(rank), parts - 1 - rank}) {
      const int32_t first = start + static_cast<int32_t>(c) * chunk;
      for (int32_t i = 0; i < chunk; ++i) {
        out.push_back(first + i);
      }
    }
  }
  return out;
}

}  // namespace bragg::pack
