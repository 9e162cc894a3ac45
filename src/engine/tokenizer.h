#pragma once

// A Hugging Face `tokenizer.json` (the `tokenizers` library's file) for bragg-engine's text
// endpoints: the byte-level BPE family that Qwen2/Qwen3, Llama 3 and GPT-2 ship. Token ids stay
// the engine's contract; this only turns text into ids and back, as `tokenizers` does.
//
// Served subset of the file (anything else is refused at load, naming the field):
//   normalizer      null | NFC | Sequence of those
//   pre_tokenizer   ByteLevel | Split (Regex pattern, behavior Isolated) | Sequence of those
//   model           BPE: vocab, merges ("a b" or ["a", "b"]), ignore_merges; no byte fallback,
//                   no subword prefix or word suffix
//   post_processor  null | ByteLevel | TemplateProcessing (single) | Sequence of those
//   decoder         null | ByteLevel
//   added_tokens    matched in the raw text, leftmost and longest first, before anything else
//                   (lstrip, rstrip and single_word must be false)
// Regexes run on ICU (the `tokenizers` crate uses Oniguruma; both are Perl-style, leftmost-first).
//
// Thread-safety: a loaded Tokenizer is immutable; Encode and Decode may run on any threads.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::engine {

class Tokenizer {
 public:
  // Reads `path` (a tokenizer.json). InvalidArgument names the first unsupported or malformed
  // field; NotFound if the file is missing.
  [[nodiscard]] static Result<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  // The same from the file's text; `origin` names it in errors.
  [[nodiscard]] static Result<std::unique_ptr<Tokenizer>> FromJson(std::string_view text,
                                                                   std::string_view origin);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // `text` must be UTF-8 (InvalidArgument otherwise). `add_special_tokens` applies the
  // post-processor's template (a BOS for Llama 3; nothing for Qwen), as `tokenizers` does.
  [[nodiscard]] Result<std::vector<int32_t>> Encode(std::string_view text,
                                                    bool add_special_tokens) const;

  // Ids to text. Bytes that do not form UTF-8 (a character cut between tokens) become U+FFFD,
  // and an id with no token (past the vocabulary: a model's padded embedding rows) adds nothing,
  // as `tokenizers` decodes.
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;
  // The bytes before that replacement (possibly not UTF-8): a stream decodes with this and holds
  // back an incomplete last character (IncompleteUtf8Tail).
  std::string DecodeBytes(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // The id of a token's text (a vocabulary entry or an added token), if there is one.
  std::optional<int32_t> TokenId(std::string_view token) const;
  // Whether `id` is an added token marked special.
  bool IsSpecial(int32_t id) const;
  // One past the largest id (vocabulary and added tokens).
  int32_t size() const;
  // The most bytes of text one token stands for: a text of more than max_token_bytes() x N bytes
  // is more than N tokens, which a server can refuse before encoding it.
  size_t max_token_bytes() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// `bytes` with every ill-formed UTF-8 sequence replaced by U+FFFD, one per maximal ill-formed
// subpart (Unicode's recommended practice, as Rust's String::from_utf8_lossy).
std::string Utf8Lossy(std::string_view bytes);

// How many bytes at the end of `text` are the start of a UTF-8 character that is not complete
// yet (0 if none): a stream holds them back until the next token completes the character.
size_t IncompleteUtf8Tail(std::string_view text);

}  // namespace bragg::engine
