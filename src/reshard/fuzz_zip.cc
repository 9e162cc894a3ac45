// libFuzzer target for the zip reader (built only with clang).

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "reshard/zip.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto entries = bragg::reshard::ReadZipDirectoryFromMemory(in);
  if (entries.ok()) {
    for (const auto& e : *entries) {
      if (e.data_offset > size || e.size > size - e.data_offset) {
        std::abort();  // an entry outside the input must never be reported
      }
    }
  }
  return 0;
}
