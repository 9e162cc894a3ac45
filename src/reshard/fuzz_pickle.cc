// libFuzzer target for the restricted pickle reader (built only with clang).

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "reshard/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  bragg::reshard::PickleLimits limits;
  limits.max_values = 1 << 20;
  auto doc = bragg::reshard::ParsePickle(
      std::string_view(reinterpret_cast<const char*>(data), size), limits);
  if (doc.ok()) {
    (void)bragg::reshard::DescribeValue(doc->root(), 16);
  }
  return 0;
}
