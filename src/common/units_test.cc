#include "common/units.h"

#include <gtest/gtest.h>

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

TEST(UnitsTest, Formats) {
  EXPECT_EQ(FormatSize(0), "0B");
  EXPECT_EQ(FormatSize(1536), "1.5KiB");
  EXPECT_EQ(FormatSize(1ull << 30), "1GiB");
}

}  // namespace
}  // namespace bragg
