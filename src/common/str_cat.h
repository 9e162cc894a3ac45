#pragma once

// Cat(a, b, ...): string concatenation by fmt's "{}" of each argument. Debian's Abseil is built
// without std::string_view support, so absl::StrCat cannot take the std::string_view arguments
// the engine and the trainer pass everywhere.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iterator>
#include <string>

#include "absl/strings/string_view.h"

#if !defined(ABSL_USES_STD_STRING_VIEW)
// Status::message() is an absl::string_view: formatted as its characters.
template <>
struct fmt::formatter<absl::string_view> : fmt::formatter<fmt::string_view> {
  template <typename FormatContext>
  auto format(absl::string_view s, FormatContext& ctx) const {
    return fmt::formatter<fmt::string_view>::format(fmt::string_view(s.data(), s.size()), ctx);
  }
};
#endif

namespace bragg {

template <typename... Args>
std::string Cat(const Args&... args) {
  std::string out;
  (fmt::format_to(std::back_inserter(out), "{}", args), ...);
  return out;
}

}  // namespace bragg
