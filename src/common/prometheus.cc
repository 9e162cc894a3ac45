#include "common/prometheus.h"

namespace bragg {
namespace {

std::string Escape(std::string_view in, bool quote) {
  std::string out;
  out.reserve(in.size());
  for (char c : in) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote) {
      out += "\\\"";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string PrometheusLabelValue(std::string_view value) { return Escape(value, true); }

std::string PrometheusHelpText(std::string_view text) { return Escape(text, false); }

}  // namespace bragg
