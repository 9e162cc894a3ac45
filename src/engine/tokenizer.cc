#include "engine/tokenizer.h"

#include <fmt/format.h>
#include <unicode/normalizer2.h>
#include <unicode/regex.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <utility>

namespace bragg::engine {
namespace {

using json = nlohmann::json;

// GPT-2's pattern, which a ByteLevel pre-tokenizer with use_regex applies.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// The continuation-byte range that may follow a UTF-8 lead byte at position `index` (1-based) of
// its character, and the character's length; length 0 for a byte that cannot start one.
struct Utf8Lead {
  int length = 0;
  unsigned char lo = 0x80;  // range of the second byte (later ones are always 80..BF)
  unsigned char hi = 0xBF;
};

Utf8Lead LeadOf(unsigned char b) {
  if (b < 0x80) {
    return {1};
  }
  if (b >= 0xC2 && b <= 0xDF) {
    return {2};
  }
  if (b == 0xE0) {
    return {3, 0xA0, 0xBF};
  }
  if (b == 0xED) {
    return {3, 0x80, 0x9F};
  }
  if (b >= 0xE1 && b <= 0xEF) {
    return {3};
  }
  if (b == 0xF0) {
    return {4, 0x90, 0xBF};
  }
  if (b >= 0xF1 && b <= 0xF3) {
    return {4};
  }
  if (b == 0xF4) {
    return {4, 0x80, 0x8F};
  }
  return {0};
}

// The length of the well-formed prefix of the character starting at `s[i]`: equal to
// LeadOf(s[i]).length when the character is complete and well formed.
int WellFormedPrefix(std::string_view s, size_t i, int* length) {
  Utf8Lead lead = LeadOf(static_cast<unsigned char>(s[i]));
  *length = lead.length;
  if (lead.length <= 1) {
    return lead.length;
  }
  int n = 1;
  while (n < lead.length && i + n < s.size()) {
    auto c = static_cast<unsigned char>(s[i + n]);
    unsigned char lo = n == 1 ? lead.lo : 0x80;
    unsigned char hi = n == 1 ? lead.hi : 0xBF;
    if (c < lo || c > hi) {
      break;
    }
    ++n;
  }
  return n;
}

bool IsUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    int length = 0;
    int n = WellFormedPrefix(s, i, &length);
    if (length == 0 || n != length) {
      return false;
    }
    i += n;
  }
  return true;
}

// GPT-2's reversible map from bytes to printable characters (as UTF-8 strings), and back.
struct ByteMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<char32_t, unsigned char> to_byte;
  ByteMap() {
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      std::string utf8;
      icu::UnicodeString(static_cast<UChar32>(c)).toUTF8String(utf8);
      to_char[b] = std::move(utf8);
      to_byte[c] = static_cast<unsigned char>(b);
    }
  }
};

const ByteMap& Bytes() {
  static const ByteMap* map = new ByteMap();  // immutable after construction
  return *map;
}

struct PreStep {
  enum Kind { kSplit, kByteLevel } kind;
  std::unique_ptr<icu::RegexPattern> regex;  // kSplit, or kByteLevel with use_regex
  bool add_prefix_space = false;             // kByteLevel
};

struct Added {
  std::string content;
  int32_t id;
  bool special;
};

std::string Where(std::string_view origin, std::string_view field) {
  return fmt::format("{}: {}", origin, field);
}

Status Unsupported(std::string_view origin, std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(
      fmt::format("{} is not supported ({}); bragg-engine reads byte-level BPE tokenizers "
                  "(Qwen2/Qwen3, Llama 3, GPT-2); start with --skip-tokenizer-init to serve "
                  "token ids only",
                  Where(origin, field), what));
}

std::string TypeOf(const json& node) {
  if (node.is_object() && node.contains("type") && node["type"].is_string()) {
    return node["type"].get<std::string>();
  }
  return "";
}

}  // namespace

struct Tokenizer::Impl {
  bool nfc = false;
  std::vector<PreStep> pre;
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // vocabulary and added tokens; "" where no id
  std::vector<char> special;             // by id
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a, b) -> (rank, new id)
  bool ignore_merges = false;
  std::optional<int32_t> unk;
  std::vector<Added> added;                  // longest content first
  std::array<bool, 256> added_first_byte{};  // whether some added token starts with the byte
  std::vector<std::vector<int32_t>> template_single;  // empty vector: the sequence
  bool has_template = false;
  size_t max_token_bytes = 1;
  const icu::Normalizer2* nfc_instance = nullptr;  // ICU-owned, immutable

  static uint64_t Key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  Status LoadNormalizer(const json& node, std::string_view origin) {
    if (node.is_null()) {
      return absl::OkStatus();
    }
    std::string type = TypeOf(node);
    if (type == "NFC") {
      nfc = true;
      return absl::OkStatus();
    }
    if (type == "Sequence" && node.contains("normalizers") && node["normalizers"].is_array()) {
      for (const json& n : node["normalizers"]) {
        BRAGG_RETURN_IF_ERROR(LoadNormalizer(n, origin));
      }
      return absl::OkStatus();
    }
    return Unsupported(origin, "normalizer", fmt::format("type {}", type.empty() ? "none" : type));
  }

  Status Compile(std::string_view pattern, std::string_view origin,
                 std::unique_ptr<icu::RegexPattern>* out) {
    UErrorCode status = U_ZERO_ERROR;
    UParseError parse{};
    // ICU's \s is Unicode's White_Space, as Oniguruma's (what `tokenizers` uses).
    out->reset(icu::RegexPattern::compile(
        icu::UnicodeString::fromUTF8(icu::StringPiece(pattern.data(), pattern.size())), 0, parse,
        status));
    if (U_FAILURE(status) || *out == nullptr) {
      return absl::InvalidArgumentError(fmt::format("{}: regex {} does not compile: {}",
                                                    Where(origin, "pre_tokenizer"), pattern,
                                                    u_errorName(status)));
    }
    return absl::OkStatus();
  }

  Status LoadPreTokenizer(const json& node, std::string_view origin) {
    std::string type = TypeOf(node);
    if (type == "Sequence" && node.contains("pretokenizers") && node["pretokenizers"].is_array()) {
      for (const json& n : node["pretokenizers"]) {
        BRAGG_RETURN_IF_ERROR(LoadPreTokenizer(n, origin));
      }
      return absl::OkStatus();
    }
    if (type == "ByteLevel") {
      PreStep step{PreStep::kByteLevel};
      step.add_prefix_space = node.value("add_prefix_space", false);
      if (node.value("use_regex", true)) {
        BRAGG_RETURN_IF_ERROR(Compile(kGpt2Pattern, origin, &step.regex));
      }
      pre.push_back(std::move(step));
      return absl::OkStatus();
    }
    if (type == "Split") {
      const json& pattern = node.value("pattern", json());
      if (!pattern.is_object() || !pattern.contains("Regex") || !pattern["Regex"].is_string()) {
        return Unsupported(origin, "pre_tokenizer Split", "only a Regex pattern is read");
      }
      if (node.value("behavior", "") != "Isolated" || node.value("invert", false)) {
        return Unsupported(origin, "pre_tokenizer Split",
                           "only behavior Isolated without invert is read");
      }
      PreStep step{PreStep::kSplit};
      BRAGG_RETURN_IF_ERROR(Compile(pattern["Regex"].get<std::string>(), origin, &step.regex));
      pre.push_back(std::move(step));
      return absl::OkStatus();
    }
    return Unsupported(origin, "pre_tokenizer",
                       fmt::format("type {}", type.empty() ? "none" : type));
  }

  Status LoadModel(const json& model, std::string_view origin) {
    if (TypeOf(model) != "BPE") {
      return Unsupported(origin, "model",
                         fmt::format("type {}", TypeOf(model).empty() ? "none" : TypeOf(model)));
    }
    for (auto [field, ok] : {std::pair{"dropout", json(nullptr)},
                             std::pair{"continuing_subword_prefix", json(nullptr)},
                             std::pair{"end_of_word_suffix", json(nullptr)}}) {
      if (model.contains(field) && !model[field].is_null() &&
          !(model[field].is_string() && model[field].get<std::string>().empty())) {
        return Unsupported(origin, fmt::format("model.{}", field), "must be null");
      }
    }
    if (model.value("byte_fallback", false)) {
      return Unsupported(origin, "model.byte_fallback", "must be false");
    }
    ignore_merges = model.value("ignore_merges", false);
    const json& v = model.value("vocab", json());
    if (!v.is_object() || v.empty()) {
      return absl::InvalidArgumentError(
          fmt::format("{} must be a non-empty object", Where(origin, "model.vocab")));
    }
    for (const auto& [token, id] : v.items()) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (1 << 24)) {
        return absl::InvalidArgumentError(
            fmt::format("{}: {} has id {}, not an integer in [0, 2^24)",
                        Where(origin, "model.vocab"), json(token).dump(), id.dump()));
      }
      vocab[token] = id.get<int32_t>();
    }
    const json& m = model.value("merges", json::array());
    if (!m.is_array()) {
      return absl::InvalidArgumentError(
          fmt::format("{} must be a list", Where(origin, "model.merges")));
    }
    for (size_t rank = 0; rank < m.size(); ++rank) {
      std::string a;
      std::string b;
      const json& e = m[rank];
      if (e.is_string()) {
        const std::string& s = e.get_ref<const std::string&>();
        size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
          return absl::InvalidArgumentError(
              fmt::format("{}[{}] is {}, not two tokens separated by a space",
                          Where(origin, "model.merges"), rank, e.dump()));
        }
        a = s.substr(0, space);
        b = s.substr(space + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        return absl::InvalidArgumentError(fmt::format(
            "{}[{}] is {}, not a pair of tokens", Where(origin, "model.merges"), rank, e.dump()));
      }
      auto ia = vocab.find(a);
      auto ib = vocab.find(b);
      auto iab = vocab.find(a + b);
      if (ia == vocab.end() || ib == vocab.end() || iab == vocab.end()) {
        return absl::InvalidArgumentError(
            fmt::format("{}[{}] ({} {}) names a token that is not in the vocabulary",
                        Where(origin, "model.merges"), rank, json(a).dump(), json(b).dump()));
      }
      // A repeated pair keeps its first (best) rank, as the file's order gives it.
      merges.try_emplace(Key(ia->second, ib->second), static_cast<int32_t>(rank), iab->second);
    }
    if (model.contains("unk_token") && model["unk_token"].is_string()) {
      auto it = vocab.find(model["unk_token"].get<std::string>());
      if (it != vocab.end()) {
        unk = it->second;
      }
    }
    return absl::OkStatus();
  }

  Status LoadPostProcessor(const json& node, std::string_view origin) {
    if (node.is_null()) {
      return absl::OkStatus();
    }
    std::string type = TypeOf(node);
    if (type == "ByteLevel") {
      return absl::OkStatus();  // offsets only
    }
    if (type == "Sequence" && node.contains("processors") && node["processors"].is_array()) {
      for (const json& n : node["processors"]) {
        BRAGG_RETURN_IF_ERROR(LoadPostProcessor(n, origin));
      }
      return absl::OkStatus();
    }
    if (type == "TemplateProcessing") {
      const json& single = node.value("single", json());
      const json& specials = node.value("special_tokens", json::object());
      if (!single.is_array() || has_template) {
        return Unsupported(origin, "post_processor", "one TemplateProcessing with a single list");
      }
      has_template = true;
      for (const json& piece : single) {
        if (piece.contains("Sequence")) {
          template_single.emplace_back();
        } else if (piece.contains("SpecialToken") && piece["SpecialToken"].contains("id")) {
          std::string name = piece["SpecialToken"]["id"].get<std::string>();
          if (!specials.contains(name) || !specials[name].contains("ids") ||
              !specials[name]["ids"].is_array() || specials[name]["ids"].empty()) {
            return absl::InvalidArgumentError(fmt::format("{}: special token {} has no ids",
                                                          Where(origin, "post_processor"),
                                                          json(name).dump()));
          }
          template_single.push_back(specials[name]["ids"].get<std::vector<int32_t>>());
        } else {
          return Unsupported(origin, "post_processor", "template piece " + piece.dump());
        }
      }
      return absl::OkStatus();
    }
    return Unsupported(origin, "post_processor", fmt::format("type {}", type));
  }

  Status LoadAdded(const json& list, std::string_view origin) {
    if (list.is_null()) {
      return absl::OkStatus();
    }
    if (!list.is_array()) {
      return absl::InvalidArgumentError(
          fmt::format("{} must be a list", Where(origin, "added_tokens")));
    }
    for (const json& t : list) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
          !t.contains("content") || !t["content"].is_string() || t["id"].get<int64_t>() < 0 ||
          t["id"].get<int64_t>() >= (1 << 24)) {
        return absl::InvalidArgumentError(
            fmt::format("{}: entry {} needs an integer id and a content",
                        Where(origin, "added_tokens"), t.dump()));
      }
      for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
        if (t.value(flag, false)) {
          return Unsupported(origin, fmt::format("added token {}.{}", t["content"].dump(), flag),
                             "must be false");
        }
      }
      Added a{t["content"].get<std::string>(), t["id"].get<int32_t>(), t.value("special", false)};
      if (a.content.empty()) {
        return absl::InvalidArgumentError(
            fmt::format("{}: an empty content", Where(origin, "added_tokens")));
      }
      added.push_back(std::move(a));
    }
    std::stable_sort(added.begin(), added.end(), [](const Added& x, const Added& y) {
      return x.content.size() > y.content.size();
    });
    for (const Added& a : added) {
      added_first_byte[static_cast<unsigned char>(a.content[0])] = true;
    }
    return absl::OkStatus();
  }

  void Index() {
    int32_t n = 0;
    for (const auto& [token, id] : vocab) {
      n = std::max(n, id + 1);
    }
    for (const Added& a : added) {
      n = std::max(n, a.id + 1);
    }
    id_to_token.assign(n, "");
    special.assign(n, 0);
    for (const auto& [token, id] : vocab) {
      id_to_token[id] = token;
      // A byte-level token's characters are one byte each.
      size_t chars = icu::UnicodeString::fromUTF8(token).countChar32();
      max_token_bytes = std::max(max_token_bytes, chars);
    }
    for (const Added& a : added) {
      id_to_token[a.id] = a.content;
      special[a.id] = a.special ? 1 : 0;
      max_token_bytes = std::max(max_token_bytes, a.content.size());
    }
  }

  // The pieces a regex cuts `s` into (matches and the gaps between them), in order.
  static Status SplitBy(const icu::RegexPattern& regex, const icu::UnicodeString& s,
                        std::vector<icu::UnicodeString>* out) {
    UErrorCode status = U_ZERO_ERROR;
    std::unique_ptr<icu::RegexMatcher> m(regex.matcher(s, status));
    // ICU's backtracking stack is 8 MB by default, which a long run of spaces against
    // `\s+(?!\S)` exhausts; it grows on the heap instead, in proportion to the text (which the
    // server's body limit bounds).
    m->setStackLimit(0, status);
    if (U_FAILURE(status)) {
      return absl::InternalError(fmt::format("regex matcher: {}", u_errorName(status)));
    }
    int32_t last = 0;
    while (m->find(status) && U_SUCCESS(status)) {
      int32_t start = m->start(status);
      int32_t end = m->end(status);
      if (end == start) {
        continue;
      }
      // Copies: tempSubString would alias `s`, which the caller frees before the pieces.
      if (start > last) {
        out->emplace_back(s, last, start - last);
      }
      out->emplace_back(s, start, end - start);
      last = end;
    }
    if (U_FAILURE(status)) {
      return absl::InvalidArgumentError(fmt::format(
          "the text is too hard for the pre-tokenizer's regex: {}", u_errorName(status)));
    }
    if (last < s.length()) {
      out->emplace_back(s, last);
    }
    return absl::OkStatus();
  }

  void Bpe(std::string_view mapped, std::vector<int32_t>* out) const {
    if (ignore_merges) {
      auto it = vocab.find(std::string(mapped));
      if (it != vocab.end()) {
        out->push_back(it->second);
        return;
      }
    }
    struct Symbol {
      int32_t id;
      int32_t prev;
      int32_t next;
      bool alive;
    };
    std::vector<Symbol> symbols;
    for (size_t i = 0; i < mapped.size();) {
      int length = 0;
      WellFormedPrefix(mapped, i, &length);
      length = std::max(length, 1);
      auto it = vocab.find(std::string(mapped.substr(i, length)));
      i += length;
      int32_t id;
      if (it != vocab.end()) {
        id = it->second;
      } else if (unk) {
        id = *unk;
      } else {
        continue;  // as `tokenizers`: a character outside the vocabulary without unk is dropped
      }
      int32_t at = static_cast<int32_t>(symbols.size());
      symbols.push_back({id, at - 1, at + 1, true});
    }
    if (symbols.empty()) {
      return;
    }
    symbols.back().next = -1;
    struct Merge {
      int32_t rank;
      int32_t pos;
      int32_t new_id;
      bool operator>(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    std::priority_queue<Merge, std::vector<Merge>, std::greater<>> queue;
    auto consider = [&](int32_t pos) {
      int32_t next = symbols[pos].next;
      if (next < 0) {
        return;
      }
      auto it = merges.find(Key(symbols[pos].id, symbols[next].id));
      if (it != merges.end()) {
        queue.push({it->second.first, pos, it->second.second});
      }
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) {
      consider(i);
    }
    while (!queue.empty()) {
      Merge top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (!left.alive || left.next < 0) {
        continue;
      }
      Symbol& right = symbols[left.next];
      auto it = merges.find(Key(left.id, right.id));
      if (it == merges.end() || it->second.first != top.rank) {
        continue;  // stale: one side merged since this entry was queued
      }
      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) {
        symbols[left.next].prev = top.pos;
      }
      if (left.prev >= 0) {
        consider(left.prev);
      }
      consider(top.pos);
    }
    for (const Symbol& s : symbols) {
      if (s.alive) {
        out->push_back(s.id);
      }
    }
  }

  // Encodes one stretch of text that holds no added token.
  Status EncodeOrdinary(std::string_view text, std::vector<int32_t>* out) const {
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), text.size()));
    if (nfc) {
      UErrorCode status = U_ZERO_ERROR;
      u = nfc_instance->normalize(u, status);
      if (U_FAILURE(status)) {
        return absl::InternalError(fmt::format("NFC: {}", u_errorName(status)));
      }
    }
    std::vector<icu::UnicodeString> pieces{u};
    std::vector<icu::UnicodeString> next;
    for (const PreStep& step : pre) {
      next.clear();
      for (icu::UnicodeString& piece : pieces) {
        if (step.kind == PreStep::kByteLevel && step.add_prefix_space &&
            (piece.isEmpty() || piece.charAt(0) != u' ')) {
          piece.insert(0, u' ');
        }
        if (step.regex) {
          BRAGG_RETURN_IF_ERROR(SplitBy(*step.regex, piece, &next));
        } else {
          next.push_back(piece);
        }
      }
      pieces.swap(next);
    }
    const ByteMap& bytes = Bytes();
    std::string raw;
    std::string mapped;
    for (const icu::UnicodeString& piece : pieces) {
      raw.clear();
      piece.toUTF8String(raw);
      if (raw.empty()) {
        continue;
      }
      mapped.clear();
      for (unsigned char c : raw) {
        mapped += bytes.to_char[c];
      }
      Bpe(mapped, out);
    }
    return absl::OkStatus();
  }
};

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

Result<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(fmt::format("cannot read {}", path));
  }
  std::stringstream text;
  text << in.rdbuf();
  return FromJson(text.str(), path);
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view text,
                                                       std::string_view origin) {
  json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(fmt::format("{} is not a JSON object", origin));
  }
  auto impl = std::make_unique<Impl>();
  UErrorCode status = U_ZERO_ERROR;
  impl->nfc_instance = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status)) {
    return absl::InternalError(fmt::format("ICU's NFC normalizer: {}", u_errorName(status)));
  }
  BRAGG_RETURN_IF_ERROR(impl->LoadModel(doc.value("model", json()), origin));
  BRAGG_RETURN_IF_ERROR(impl->LoadNormalizer(doc.value("normalizer", json()), origin));
  BRAGG_RETURN_IF_ERROR(impl->LoadPreTokenizer(doc.value("pre_tokenizer", json()), origin));
  bool byte_level = std::any_of(impl->pre.begin(), impl->pre.end(),
                                [](const PreStep& s) { return s.kind == PreStep::kByteLevel; });
  if (!byte_level) {
    return Unsupported(origin, "pre_tokenizer", "it has no ByteLevel step");
  }
  BRAGG_RETURN_IF_ERROR(impl->LoadPostProcessor(doc.value("post_processor", json()), origin));
  const json& decoder = doc.value("decoder", json());
  if (!decoder.is_null() && TypeOf(decoder) != "ByteLevel") {
    return Unsupported(origin, "decoder", fmt::format("type {}", TypeOf(decoder)));
  }
  BRAGG_RETURN_IF_ERROR(impl->LoadAdded(doc.value("added_tokens", json()), origin));
  impl->Index();
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

Result<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                               bool add_special_tokens) const {
  if (!IsUtf8(text)) {
    return absl::InvalidArgumentError("the text is not valid UTF-8");
  }
  std::vector<int32_t> ids;
  size_t done = 0;
  for (size_t i = 0; i < text.size();) {
    const Added* hit = nullptr;
    if (!impl_->added_first_byte[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    for (const Added& a : impl_->added) {  // longest first: the first hit is the longest
      if (text.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    if (i > done) {
      BRAGG_RETURN_IF_ERROR(impl_->EncodeOrdinary(text.substr(done, i - done), &ids));
    }
    ids.push_back(hit->id);
    i += hit->content.size();
    done = i;
  }
  if (done < text.size()) {
    BRAGG_RETURN_IF_ERROR(impl_->EncodeOrdinary(text.substr(done), &ids));
  }
  if (!add_special_tokens || !impl_->has_template) {
    return ids;
  }
  std::vector<int32_t> out;
  for (const std::vector<int32_t>& piece : impl_->template_single) {
    const std::vector<int32_t>& add = piece.empty() ? ids : piece;
    out.insert(out.end(), add.begin(), add.end());
  }
  return out;
}

std::string Tokenizer::DecodeBytes(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const ByteMap& bytes = Bytes();
  std::string out;
  for (int32_t id : ids) {
    if (id < 0 || id >= size() || (skip_special_tokens && impl_->special[id])) {
      continue;
    }
    const std::string& token = impl_->id_to_token[id];
    // Each character maps back to its byte; a token with a character outside the map (an added
    // token's own text) is taken as it is, as `tokenizers`' ByteLevel decoder does.
    std::string decoded;
    bool mapped = true;
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(token);
    for (int32_t i = 0; i < u.length();) {
      UChar32 c = u.char32At(i);
      auto it = bytes.to_byte.find(static_cast<char32_t>(c));
      if (it == bytes.to_byte.end()) {
        mapped = false;
        break;
      }
      decoded.push_back(static_cast<char>(it->second));
      i += U16_LENGTH(c);
    }
    out += mapped ? decoded : token;
  }
  return out;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return Utf8Lossy(DecodeBytes(ids, skip_special_tokens));
}

std::optional<int32_t> Tokenizer::TokenId(std::string_view token) const {
  for (const Added& a : impl_->added) {
    if (a.content == token) {
      return a.id;
    }
  }
  auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) {
    return std::nullopt;
  }
  return it->second;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < size() && impl_->special[id] != 0;
}

int32_t Tokenizer::size() const { return static_cast<int32_t>(impl_->id_to_token.size()); }

size_t Tokenizer::max_token_bytes() const { return impl_->max_token_bytes; }

std::string Utf8Lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    int length = 0;
    int n = WellFormedPrefix(bytes, i, &length);
    if (length != 0 && n == length) {
      out.append(bytes.substr(i, n));
      i += n;
      continue;
    }
    out += "\xEF\xBF\xBD";
    i += std::max(n, 1);
  }
  return out;
}

size_t IncompleteUtf8Tail(std::string_view text) {
  for (size_t k = 1; k <= 3 && k <= text.size(); ++k) {
    size_t at = text.size() - k;
    auto b = static_cast<unsigned char>(text[at]);
    if (b >= 0x80 && b <= 0xBF) {
      continue;  // a continuation byte: look further back for its lead
    }
    int length = 0;
    int n = WellFormedPrefix(text, at, &length);
    return length > static_cast<int>(k) && n == static_cast<int>(k) ? k : 0;
  }
  return 0;
}

}  // namespace bragg::engine
