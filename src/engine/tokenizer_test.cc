// The tokenizer on hand-made tokenizer.json files: merges, added tokens, templates, Unicode edge
// cases and hostile input. Its agreement with Hugging Face `tokenizers` on trained files is
// tests/engine/test_tokenizer.py.
#include "engine/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace bragg::engine {
namespace {

using json = nlohmann::json;

std::string Utf8(char32_t c) {
  std::string s;
  if (c < 0x80) {
    s += static_cast<char>(c);
  } else if (c < 0x800) {
    s += static_cast<char>(0xC0 | (c >> 6));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    s += static_cast<char>(0xE0 | (c >> 12));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (c >> 18));
    s += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (c & 0x3F));
  }
  return s;
}

// GPT-2's byte-to-character table, written out again here: byte b is token id b.
std::vector<std::string> ByteTokens() {
  std::vector<std::string> out(256);
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    out[b] = Utf8(keep ? b : 256 + n++);
  }
  return out;
}

const std::string kSpace = Utf8(0x120);  // Ġ: the byte 0x20

// A Qwen2-shaped file: NFC, the Qwen2 split regex then ByteLevel, a few merges, ChatML tokens.
json QwenLike() {
  json vocab = json::object();
  std::vector<std::string> bytes = ByteTokens();
  for (int b = 0; b < 256; ++b) {
    vocab[bytes[b]] = b;
  }
  int next = 256;
  json merges = json::array();
  for (auto [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"h", "e"}, {kSpace, "t"}, {kSpace + "t", "he"}, {"!", "!"}, {"!!", "!!"}}) {
    vocab[a + b] = next++;
    merges.push_back(a + " " + b);
  }
  return {
      {"version", "1.0"},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {{{"type", "Split"},
               {"pattern",
                {{"Regex",
                  R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"},
               {"add_prefix_space", false},
               {"trim_offsets", false},
               {"use_regex", false}}})}}},
      {"post_processor", {{"type", "ByteLevel"}, {"trim_offsets", false}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merges}}},
      {"added_tokens", json::array({{{"id", 300}, {"content", "<|im_start|>"}, {"special", true}},
                                    {{"id", 301}, {"content", "<|im_end|>"}, {"special", true}},
                                    {{"id", 302}, {"content", "<|im"}, {"special", false}}})},
  };
}

std::unique_ptr<Tokenizer> Make(const json& doc) {
  auto t = Tokenizer::FromJson(doc.dump(), "test.json");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

std::vector<int32_t> Ids(const Tokenizer& t, std::string_view text, bool special = true) {
  auto ids = t.Encode(text, special);
  EXPECT_TRUE(ids.ok()) << ids.status();
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

TEST(Tokenizer, MergesInRankOrder) {
  auto t = Make(QwenLike());
  ASSERT_NE(t, nullptr);
  int32_t the = *t->TokenId(kSpace + "the");
  int32_t he = *t->TokenId("he");
  EXPECT_EQ(Ids(*t, " the"), std::vector<int32_t>{the});
  EXPECT_EQ(Ids(*t, "the"), (std::vector<int32_t>{'t', he}));
  // "!!!!!" is one pre-token: two "!!" merges leftmost first, then "!!!!", then the last "!".
  EXPECT_EQ(Ids(*t, "!!!!!"), (std::vector<int32_t>{*t->TokenId("!!!!"), '!'}));
  EXPECT_EQ(Ids(*t, "a the"), (std::vector<int32_t>{'a', the}));
}

TEST(Tokenizer, AddedTokensMatchLongestFirstAndDecodeAsThemselves) {
  auto t = Make(QwenLike());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Ids(*t, "<|im_start|>a<|im_end|>"), (std::vector<int32_t>{300, 'a', 301}));
  EXPECT_EQ(Ids(*t, "<|im_sta"), (std::vector<int32_t>{302, '_', 's', 't', 'a'}));
  EXPECT_EQ(t->Decode(std::vector<int32_t>{300, 'a', 301, 302}, false),
            "<|im_start|>a<|im_end|><|im");
  // Only tokens marked special are skipped.
  EXPECT_EQ(t->Decode(std::vector<int32_t>{300, 'a', 301, 302}, true), "a<|im");
  EXPECT_TRUE(t->IsSpecial(300));
  EXPECT_FALSE(t->IsSpecial(302));
  EXPECT_FALSE(t->IsSpecial(-1));
  EXPECT_FALSE(t->IsSpecial(1 << 20));
  EXPECT_EQ(t->max_token_bytes(), std::string("<|im_start|>").size());
}

TEST(Tokenizer, RandomUnicodeRoundTrips) {
  json doc = QwenLike();
  doc["normalizer"] = nullptr;  // NFC would change some texts; without it decode is exact
  auto t = Make(doc);
  ASSERT_NE(t, nullptr);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> kind(0, 5);
  for (int round = 0; round < 300; ++round) {
    std::string s;
    int n = rng() % 40;
    for (int i = 0; i < n; ++i) {
      char32_t c;
      switch (kind(rng)) {
        case 0:
          c = U" \t\n\r\v\x85\xA0"[rng() % 7];
          break;
        case 1:
          c = 0x20 + rng() % 95;
          break;
        case 2:
          c = 0x80 + rng() % 0x780;
          break;
        case 3:
          c = 0x4E00 + rng() % 0x5000;
          break;
        case 4:
          c = 0x1F300 + rng() % 0x300;
          break;
        default:
          c = U"'sStTmd"[rng() % 7];
      }
      s += Utf8(c);
    }
    auto ids = t->Encode(s, true);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(t->Decode(*ids, false), s);
  }
}

TEST(Tokenizer, NfcMakesCombiningSequencesOneCharacter) {
  auto t = Make(QwenLike());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Ids(*t, "e\xCC\x81"), Ids(*t, "\xC3\xA9"));  // e + U+0301 == U+00E9
}

TEST(Tokenizer, TemplateAddsItsTokensOnlyWhenAsked) {
  json doc = QwenLike();
  json tmpl = {{"type", "TemplateProcessing"}, {"pair", json::array()}};
  tmpl["single"] = json::array({{{"SpecialToken", {{"id", "<|im_start|>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}});
  tmpl["special_tokens"]["<|im_start|>"] = {{"id", "<|im_start|>"}, {"ids", json::array({300})}};
  doc["post_processor"] = {{"type", "Sequence"},
                           {"processors", json::array({{{"type", "ByteLevel"}}, tmpl})}};
  auto t = Make(doc);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(Ids(*t, "a", true), (std::vector<int32_t>{300, 'a'}));
  EXPECT_EQ(Ids(*t, "a", false), (std::vector<int32_t>{'a'}));
  EXPECT_EQ(Ids(*t, "", true), (std::vector<int32_t>{300}));
}

TEST(Tokenizer, RefusesTextThatIsNotUtf8) {
  auto t = Make(QwenLike());
  ASSERT_NE(t, nullptr);
  for (std::string bad : {std::string("\xFF"), std::string("a\xC3"), std::string("\xED\xA0\x80"),
                          std::string("\xC0\xAF"), std::string("\xF4\x90\x80\x80")}) {
    auto ids = t->Encode(bad, true);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << Utf8Lossy(bad);
  }
  EXPECT_TRUE(t->Encode(std::string("a\0b", 3), true).ok());  // NUL is a character
}

TEST(Tokenizer, DecodeReplacesCutCharactersAndSkipsIdsWithoutAToken) {
  auto t = Make(QwenLike());
  ASSERT_NE(t, nullptr);
  std::vector<int32_t> ids = Ids(*t, "\xE2\x82\xAC");  // €: three byte tokens
  ASSERT_EQ(ids.size(), 3u);
  std::vector<int32_t> cut(ids.begin(), ids.begin() + 2);
  std::string raw = t->DecodeBytes(cut, true);
  EXPECT_EQ(raw, "\xE2\x82");
  EXPECT_EQ(IncompleteUtf8Tail(raw), 2u);
  EXPECT_EQ(t->Decode(cut, true), "\xEF\xBF\xBD");
  // Past the end, negative, and a hole in the ids: nothing, as `tokenizers`.
  EXPECT_EQ(t->Decode(std::vector<int32_t>{'a', t->size(), -1, 290, 1 << 30, 'b'}, false), "ab");
}

TEST(Utf8, LossyFollowsTheMaximalSubpartRule) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(Utf8Lossy("abc"), "abc");
  EXPECT_EQ(Utf8Lossy("\xE1\x80"), r);              // a cut 3-byte character: one
  EXPECT_EQ(Utf8Lossy("\xF0\x80\x80"), r + r + r);  // F0 80 is never valid: three
  EXPECT_EQ(Utf8Lossy("\xED\xA0\x80"), r + r + r);  // a surrogate: three
  EXPECT_EQ(Utf8Lossy("\xF1\x80\x80\xE1\x80\xC2"), r + r + r);
  EXPECT_EQ(Utf8Lossy("a\xFF"
                      "b"),
            "a" + r + "b");
  EXPECT_EQ(Utf8Lossy("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
}

TEST(Utf8, IncompleteTailOnlyCountsAStartThatCanStillComplete) {
  EXPECT_EQ(IncompleteUtf8Tail(""), 0u);
  EXPECT_EQ(IncompleteUtf8Tail("ab"), 0u);
  EXPECT_EQ(IncompleteUtf8Tail("a\xC3"), 1u);
  EXPECT_EQ(IncompleteUtf8Tail("a\xF0\x9F\x98"), 3u);
  EXPECT_EQ(IncompleteUtf8Tail("a\xF0\x9F\x98\x80"), 0u);  // complete
  EXPECT_EQ(IncompleteUtf8Tail("a\xF0\x80"), 0u);          // can never complete
  EXPECT_EQ(IncompleteUtf8Tail("\x80\x80\x80"), 0u);
}

TEST(Tokenizer, RefusesWhatItDoesNotReadNamingTheField) {
  struct Case {
    const char* pointer;
    json value;
    const char* names;
  };
  std::vector<Case> cases = {
      {"/model/type", "WordPiece", "model"},
      {"/model/byte_fallback", true, "model.byte_fallback"},
      {"/model/dropout", 0.1, "model.dropout"},
      {"/normalizer", {{"type", "Lowercase"}}, "normalizer"},
      {"/decoder", {{"type", "WordPiece"}}, "decoder"},
      {"/pre_tokenizer", {{"type", "Metaspace"}}, "pre_tokenizer"},
      {"/pre_tokenizer/pretokenizers/0/behavior", "Removed", "Split"},
      {"/pre_tokenizer/pretokenizers/1", {{"type", "Whitespace"}}, "pre_tokenizer"},
      {"/pre_tokenizer/pretokenizers/0/pattern", {{"String", " "}}, "Split"},
      {"/pre_tokenizer/pretokenizers/0/pattern/Regex", "(unclosed", "does not compile"},
      {"/added_tokens/0/lstrip", true, "lstrip"},
      {"/added_tokens/0/content", "", "empty content"},
      {"/added_tokens/0/id", -4, "integer id"},
      {"/model/vocab/a", "x", "model.vocab"},
      {"/model/merges/0", "h e x", "model.merges[0]"},
      {"/model/merges/1", json::array({"Q", "zz"}), "not in the vocabulary"},
      {"/post_processor", {{"type", "BertProcessing"}}, "post_processor"},
  };
  for (const Case& c : cases) {
    json doc = QwenLike();
    doc[json::json_pointer(c.pointer)] = c.value;
    auto t = Tokenizer::FromJson(doc.dump(), "tok.json");
    ASSERT_FALSE(t.ok()) << c.pointer;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << c.pointer;
    EXPECT_NE(t.status().message().find(c.names), std::string::npos)
        << c.pointer << ": " << t.status();
  }
  for (std::string text : {"", "[]", "{", "null", "{\"model\": 3}"}) {
    EXPECT_FALSE(Tokenizer::FromJson(text, "x").ok()) << text;
  }
  EXPECT_EQ(Tokenizer::Load("/nonexistent/tokenizer.json").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(Tokenizer, LongHostileTextsEncode) {
  auto t = Make(QwenLike());
  ASSERT_NE(t, nullptr);
  // One pre-token of a million characters: the merge queue, not a quadratic rescan.
  std::vector<int32_t> ids = Ids(*t, std::string(1 << 20, '!'));
  EXPECT_EQ(ids.size(), (1u << 20) / 4);
  // Near-misses of an added token everywhere.
  std::string near;
  for (int i = 0; i < 100000; ++i) {
    near += "<|im_star";
  }
  ids = Ids(*t, near);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 302), 100000);
  // A million spaces, then a million newlines.
  EXPECT_FALSE(Ids(*t, std::string(1 << 20, ' ')).empty());
  EXPECT_FALSE(Ids(*t, std::string(1 << 20, '\n')).empty());
}

TEST(Tokenizer, ConcurrentEncodesAgree) {
  auto t = Make(QwenLike());
  ASSERT_NE(t, nullptr);
  const std::string text = "<|im_start|>user the théorie 12345 !!!!\n\n  x<|im_end|>";
  std::vector<int32_t> want = Ids(*t, text);
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      for (int j = 0; j < 200; ++j) {
        auto ids = t->Encode(text, true);
        if (!ids.ok() || *ids != want) {
          bad++;
        }
      }
    });
  }
  for (std::thread& th : threads) {
    th.join();
  }
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace bragg::engine
