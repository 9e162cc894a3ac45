#pragma once

// Cat(a, b, ...): string concatenation by fmt's "{}" of each argument. Debian's Abseil is built
// without std::string_view support, so absl::StrCat cannot take the std::string_view arguments
// the engine and the trainer pass everywhere.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iterator>
#include <string>

namespace bragg {

template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (fmt::format_to(std::back_inserter(out), "{}", args), ...);
  return out;
}

}  // namespace bragg
