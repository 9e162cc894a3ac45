#include "gateway/routed_experts.h"

#include <fmt/format.h>

#include <cstring>

#include "absl/strings/escaping.h"
#include "common/hash.h"

namespace bragg::gateway {

uint32_t VersionId(std::string_view version) {
  uint32_t h = 2166136261u;
  for (unsigned char c : version) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

void AppendSimRoutedExperts(std::span<const int32_t> tokens, std::span<const uint32_t> version_ids,
                            size_t begin, size_t end, const MoeShape& shape,
                            std::vector<int32_t>* out) {
  out->reserve(out->size() + (end - begin) * shape.per_token());
  for (size_t pos = begin; pos < end; ++pos) {
    uint64_t base =
        SplitMix64((static_cast<uint64_t>(static_cast<uint32_t>(tokens[pos])) << 32) ^ pos);
    base = SplitMix64(base ^ version_ids[pos]);
    for (int layer = 0; layer < shape.layers; ++layer) {
      uint64_t h = SplitMix64(base + static_cast<uint64_t>(layer));
      for (int k = 0; k < shape.top_k; ++k) {
        out->push_back(
            static_cast<int32_t>((h >> (k * 7)) % static_cast<uint64_t>(shape.num_experts)));
      }
    }
  }
}

std::string EncodeRoutedExperts(std::span<const int32_t> experts) {
  std::string bytes(experts.size() * sizeof(int32_t), '\0');
  // Little-endian hosts only (x86-64, aarch64), as SGLang's numpy tobytes().
  std::memcpy(bytes.data(), experts.data(), bytes.size());
  return absl::Base64Escape(bytes);
}

Result<std::vector<int32_t>> DecodeRoutedExperts(std::string_view base64) {
  std::string bytes;
  if (!absl::Base64Unescape(std::string(base64), &bytes)) {
    return absl::InvalidArgumentError("routed_experts is not valid base64");
  }
  if (bytes.size() % sizeof(int32_t) != 0) {
    return absl::InvalidArgumentError(
        fmt::format("routed_experts has {} bytes, not a whole number of int32", bytes.size()));
  }
  std::vector<int32_t> out(bytes.size() / sizeof(int32_t));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

Status RoutedExpertsAssembler::Append(size_t start_len, size_t total_tokens,
                                      std::span<const int32_t> suffix) {
  if (start_len != positions_) {
    return absl::InvalidArgumentError(fmt::format(
        "routed experts suffix starts at {} but {} positions are cached", start_len, positions_));
  }
  if (total_tokens == 0 || total_tokens - 1 < start_len) {
    return absl::InvalidArgumentError(
        fmt::format("total tokens {} is before start {}", total_tokens, start_len));
  }
  size_t count = total_tokens - 1 - start_len;
  if (count == 0) {
    if (!suffix.empty()) {
      return absl::InvalidArgumentError("routed experts for zero new positions");
    }
    return absl::OkStatus();
  }
  if (suffix.size() % count != 0) {
    return absl::InvalidArgumentError(fmt::format(
        "routed experts suffix of {} ids does not divide into {} positions", suffix.size(), count));
  }
  size_t per_token = suffix.size() / count;
  if (per_token_ != 0 && per_token != per_token_) {
    return absl::InvalidArgumentError(
        fmt::format("routed experts width changed from {} to {} per token", per_token_, per_token));
  }
  per_token_ = per_token;
  data_.insert(data_.end(), suffix.begin(), suffix.end());
  positions_ = total_tokens - 1;
  return absl::OkStatus();
}

void RoutedExpertsAssembler::Reset() {
  positions_ = 0;
  per_token_ = 0;
  data_.clear();
}

}  // namespace bragg::gateway
