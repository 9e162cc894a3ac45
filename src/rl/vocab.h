#pragma once

// A character-level vocabulary: token i is the string at entry i of a JSON list. bragg-engine
// takes and returns token ids; bragg-rl turns prompts and tool output into ids with this, and a
// model turn back into text for the tool server. Encoding is greedy longest match, so
// multi-character entries ("<eos>") win over their first character.

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::rl {

class Vocab {
 public:
  // InvalidArgument for a file that is not a JSON list of distinct non-empty strings.
  static Result<Vocab> Load(const std::string& path);
  static Result<Vocab> FromTokens(std::vector<std::string> tokens);

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  std::optional<int32_t> Id(std::string_view token) const;

  // InvalidArgument naming the first character no entry covers (and its offset).
  Result<std::vector<int32_t>> Encode(std::string_view text) const;
  // Text the model did not write (tool output): what no entry covers becomes `fallback` (when
  // set) or is dropped. Never fails.
  std::vector<int32_t> EncodeLossy(std::string_view text) const;
  // Out-of-range ids decode as "\xEF\xBF\xBD" (U+FFFD).
  std::string Decode(std::span<const int32_t> ids) const;

 private:
  // Longest entry matching `text` at its start: (id, length); nullopt when none.
  std::optional<std::pair<int32_t, size_t>> Match(std::string_view text) const;

  std::vector<std::string> tokens_;
  std::map<std::string, int32_t, std::less<>> ids_;
  size_t longest_ = 0;
  std::optional<int32_t> fallback_;  // "?" when the vocabulary has it
};

}  // namespace bragg::rl
