#pragma once

// Routed-experts arrays as SGLang returns them in meta_info.routed_experts: int32
// [tokens - 1, layers, top_k], little-endian, base64. The simulator's deterministic generator and
// the client's delta reassembly (SGLang PR #24851, routed_experts_start_len) live here.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::gateway {

struct MoeShape {
  int layers = 4;
  int top_k = 2;
  int num_experts = 64;
  size_t per_token() const { return static_cast<size_t>(layers) * static_cast<size_t>(top_k); }
};

// Expert ids for positions [begin, end) of `tokens`, whose KV was computed under the weight
// versions `version_ids` (one per token, same length as `tokens`). Deterministic in (token,
// position, layer, version) so that any two computations of a position agree. Requires
// begin <= end <= tokens.size().
void AppendSimRoutedExperts(std::span<const int32_t> tokens, std::span<const uint32_t> version_ids,
                            size_t begin, size_t end, const MoeShape& shape,
                            std::vector<int32_t>* out);

// Numeric id of a weight version string (stable across processes).
uint32_t VersionId(std::string_view version);

std::string EncodeRoutedExperts(std::span<const int32_t> experts);
// InvalidArgument on bad base64 or a byte count that is not a multiple of 4.
Result<std::vector<int32_t>> DecodeRoutedExperts(std::string_view base64);

// Client-side cache of one rollout's routed experts, grown one suffix per turn. Not thread-safe.
class RoutedExpertsAssembler {
 public:
  // Positions (tokens) already held: the routed_experts_start_len of the next request.
  size_t positions() const { return positions_; }
  const std::vector<int32_t>& data() const { return data_; }

  // Appends `suffix`, the experts of positions [start_len, total_tokens - 1). InvalidArgument if
  // start_len is not positions() or the size does not divide into whole positions.
  Status Append(size_t start_len, size_t total_tokens, std::span<const int32_t> suffix);
  void Reset();

 private:
  size_t positions_ = 0;
  size_t per_token_ = 0;
  std::vector<int32_t> data_;
};

}  // namespace bragg::gateway
