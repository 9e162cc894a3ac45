#include "common/prometheus.h"

#include <gtest/gtest.h>

#include <string>

namespace bragg {
namespace {

TEST(PrometheusLabelValueTest, EscapesWhatWouldEndOrBreakTheValue) {
  EXPECT_EQ(PrometheusLabelValue(""), "");
  EXPECT_EQ(PrometheusLabelValue("http://10.0.0.1:30000"), "http://10.0.0.1:30000");
  EXPECT_EQ(PrometheusLabelValue("a\"b"), "a\\\"b");
  EXPECT_EQ(PrometheusLabelValue("a\\b"), "a\\\\b");
  EXPECT_EQ(PrometheusLabelValue("a\nb"), "a\\nb");
  // A value that tries to close its label and add a line of its own stays one value.
  EXPECT_EQ(PrometheusLabelValue("x\"} 1\nfake_metric 2\n"), "x\\\"} 1\\nfake_metric 2\\n");
  // Other bytes (tabs, carriage returns, UTF-8, NUL) are legal as they are.
  const std::string raw = std::string("\t\r\xc3\xa9") + '\0' + "z";
  EXPECT_EQ(PrometheusLabelValue(raw), raw);
}

TEST(PrometheusHelpTextTest, EscapesBackslashAndLineFeedOnly) {
  EXPECT_EQ(PrometheusHelpText("plain"), "plain");
  EXPECT_EQ(PrometheusHelpText("a\\b\nc"), "a\\\\b\\nc");
  // A help line may hold double quotes as they are.
  EXPECT_EQ(PrometheusHelpText("the \"ready\" state"), "the \"ready\" state");
  EXPECT_EQ(PrometheusHelpText("x\n# TYPE fake counter"), "x\\n# TYPE fake counter");
}

}  // namespace
}  // namespace bragg
