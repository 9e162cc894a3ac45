#include "common/units.h"

#include <cctype>
#include <cmath>
#include <cstdlib>

#include "fmt/format.h"

namespace bragg {

Result<uint64_t> ParseSize(std::string_view text) {
  auto bad = [&] {
    return absl::InvalidArgumentError(fmt::format(
        "bad size \"{}\": use a number with an optional unit, e.g. 512M, 1G, 1.5GiB", text));
  };
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) {
    ++i;
  }
  if (i == 0) {
    return bad();
  }
  std::string number(text.substr(0, i));
  char* end = nullptr;
  double value = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size() || !std::isfinite(value) || value < 0) {
    return bad();
  }
  std::string unit(text.substr(i));
  for (char& c : unit) {
    c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  double mult;
  if (unit.empty() || unit == "B") {
    mult = 1;
  } else if (unit == "K" || unit == "KB" || unit == "KIB") {
    mult = 1024.0;
  } else if (unit == "M" || unit == "MB" || unit == "MIB") {
    mult = 1024.0 * 1024;
  } else if (unit == "G" || unit == "GB" || unit == "GIB") {
    mult = 1024.0 * 1024 * 1024;
  } else if (unit == "T" || unit == "TB" || unit == "TIB") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else if (unit == "P" || unit == "PB" || unit == "PIB") {
    // FormatSize prints PiB, so what it prints must parse.
    mult = 1024.0 * 1024 * 1024 * 1024 * 1024;
  } else {
    return bad();
  }
  double bytes = value * mult;
  if (bytes >= 9.2e18) {
    return bad();
  }
  return static_cast<uint64_t>(std::llround(bytes));
}

std::string FormatSize(uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  double v = static_cast<double>(bytes);
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  if (v == std::floor(v)) {
    return fmt::format("{}{}", static_cast<uint64_t>(v), kUnits[u]);
  }
  return fmt::format("{:.1f}{}", v, kUnits[u]);
}

}  // namespace bragg
