#include "common/units.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "common/fs.h"

namespace bragg {
namespace {

TEST(UnitsTest, ParsesCommonForms) {
  EXPECT_EQ(*ParseSize("4096"), 4096u);
  EXPECT_EQ(*ParseSize("512K"), 512u << 10);
  EXPECT_EQ(*ParseSize("512m"), 512u << 20);
  EXPECT_EQ(*ParseSize("1G"), 1ull << 30);
  EXPECT_EQ(*ParseSize("1.5GiB"), 3ull << 29);
  EXPECT_EQ(*ParseSize("2TB"), 2ull << 40);
}

TEST(UnitsTest, RejectsHostileInput) {
  for (const char* bad : {"", "G", "-1G", "1X", "1.2.3M", "1e9", "nan", "inf", " 1G", "1G ",
                          "99999999999T", "0x10"}) {
    EXPECT_FALSE(ParseSize(bad).ok()) << bad;
  }
  EXPECT_NE(std::string(ParseSize("1X").status().message()).find("1X"), std::string::npos);
}

// The vectors pbox.parse_size (python/pbox/_common.py) is checked against too.
TEST(UnitsTest, SharedVectors) {
  auto text = ReadFileToString(BRAGG_SIZES_JSON);
  ASSERT_TRUE(text.ok()) << text.status();
  nlohmann::json vectors = nlohmann::json::parse(*text).at("vectors");
  ASSERT_GT(vectors.size(), 50u);
  for (const auto& [input, expected] : vectors.items()) {
    auto parsed = ParseSize(input);
    if (expected.is_string()) {
      ASSERT_EQ(expected.get<std::string>(), "error") << input;
      EXPECT_FALSE(parsed.ok()) << "\"" << input << "\" -> " << *parsed;
      if (!parsed.ok()) {
        EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << input;
      }
    } else {
      ASSERT_TRUE(parsed.ok()) << "\"" << input << "\": " << parsed.status();
      EXPECT_EQ(*parsed, expected.get<uint64_t>()) << input;
    }
  }
}

TEST(UnitsTest, Formats) {
  EXPECT_EQ(FormatSize(0), "0B");
  EXPECT_EQ(FormatSize(1536), "1.5KiB");
  EXPECT_EQ(FormatSize(1ull << 30), "1GiB");
}

// Found by tests/fuzz/parsers_fuzz.cc: FormatSize prints PiB for sizes from 1 PiB up, which
// ParseSize refused, so a size the agent printed could not be given back to it.
TEST(UnitsTest, WhatFormatSizePrintsParses) {
  EXPECT_EQ(*ParseSize("1P"), 1ull << 50);
  EXPECT_EQ(*ParseSize("2PiB"), 2ull << 50);
  for (uint64_t v : std::initializer_list<uint64_t>{0, 1536, 1ull << 30, 1ull << 50,
                                                    999999ull << 40, (1ull << 62) + 12345}) {
    std::string text = FormatSize(v);
    auto back = ParseSize(text);
    ASSERT_TRUE(back.ok()) << text << ": " << back.status();
    EXPECT_NEAR(static_cast<double>(*back), static_cast<double>(v), 0.05 * static_cast<double>(v))
        << text;
  }
  EXPECT_FALSE(ParseSize("9000P").ok());  // past 2^63
}

}  // namespace
}  // namespace bragg
