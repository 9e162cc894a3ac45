#pragma once

// Prometheus text exposition format (0.0.4) helpers shared by every part's /metrics.

#include <string>
#include <string_view>

namespace bragg {

// A label value as it goes between the double quotes: backslash, double quote and line feed
// escaped, every other byte as it is.
std::string PrometheusLabelValue(std::string_view value);

// A # HELP line's text: backslash and line feed escaped (a double quote stays as it is).
std::string PrometheusHelpText(std::string_view text);

}  // namespace bragg
