#include "rl/vocab.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/str_cat.h"

namespace bragg::rl {

Result<Vocab> Vocab::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(Cat(path, ": cannot read the vocabulary"));
  }
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, false);
  if (!j.is_array()) {
    return absl::InvalidArgumentError(Cat(path, ": a vocabulary is a JSON list of token strings"));
  }
  std::vector<std::string> tokens;
  for (size_t i = 0; i < j.size(); ++i) {
    if (!j[i].is_string()) {
      return absl::InvalidArgumentError(Cat(path, ": entry ", i, " is not a string"));
    }
    tokens.push_back(j[i].get<std::string>());
  }
  auto v = FromTokens(std::move(tokens));
  if (!v.ok()) {
    return absl::InvalidArgumentError(Cat(path, ": ", v.status().message()));
  }
  return v;
}

Result<Vocab> Vocab::FromTokens(std::vector<std::string> tokens) {
  if (tokens.empty()) {
    return absl::InvalidArgumentError("the vocabulary is empty");
  }
  if (tokens.size() > (size_t{1} << 30)) {
    return absl::InvalidArgumentError("the vocabulary is too large");
  }
  Vocab v;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i].empty()) {
      return absl::InvalidArgumentError(Cat("entry ", i, " is empty"));
    }
    if (!v.ids_.emplace(tokens[i], static_cast<int32_t>(i)).second) {
      return absl::InvalidArgumentError(Cat("entry ", i, " repeats an earlier one"));
    }
    v.longest_ = std::max(v.longest_, tokens[i].size());
  }
  v.tokens_ = std::move(tokens);
  v.fallback_ = v.Id("?");
  return v;
}

std::optional<int32_t> Vocab::Id(std::string_view token) const {
  auto it = ids_.find(token);
  if (it == ids_.end()) {
    return std::nullopt;
  }
  return it->second;
}

std::optional<std::pair<int32_t, size_t>> Vocab::Match(std::string_view text) const {
  for (size_t n = std::min(longest_, text.size()); n > 0; --n) {
    auto it = ids_.find(text.substr(0, n));
    if (it != ids_.end()) {
      return std::pair{it->second, n};
    }
  }
  return std::nullopt;
}

Result<std::vector<int32_t>> Vocab::Encode(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  size_t at = 0;
  while (at < text.size()) {
    auto m = Match(text.substr(at));
    if (!m) {
      unsigned char c = static_cast<unsigned char>(text[at]);
      return absl::InvalidArgumentError(Cat("no token for byte 0x", "0123456789abcdef"[c >> 4],
                                            "0123456789abcdef"[c & 15], " at offset ", at));
    }
    ids.push_back(m->first);
    at += m->second;
  }
  return ids;
}

std::vector<int32_t> Vocab::EncodeLossy(std::string_view text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  size_t at = 0;
  while (at < text.size()) {
    auto m = Match(text.substr(at));
    if (m) {
      ids.push_back(m->first);
      at += m->second;
      continue;
    }
    if (fallback_) {
      ids.push_back(*fallback_);
    }
    // Skip the whole UTF-8 sequence the byte starts (or the stray byte).
    unsigned char c = static_cast<unsigned char>(text[at]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    at += std::min(len, text.size() - at);
  }
  return ids;
}

std::string Vocab::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    if (id >= 0 && static_cast<size_t>(id) < tokens_.size()) {
      out += tokens_[static_cast<size_t>(id)];
    } else {
      out += "\xEF\xBF\xBD";
    }
  }
  return out;
}

}  // namespace bragg::rl
