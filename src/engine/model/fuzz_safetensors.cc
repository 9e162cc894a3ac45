// Fuzz target for the safetensors header reader and the config parser: any bytes give a Status,
// never a crash, and every tensor reported lies inside the input with the size its dtype and
// shape need.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "engine/model/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto views = bragg::engine::ParseSafetensors(data, size, "fuzz.safetensors");
  if (views.ok()) {
    for (const auto& v : *views) {
      if (v.data < data || v.data + v.bytes > data + size) {
        std::abort();  // a tensor outside the input must never be reported
      }
      unsigned __int128 elems = 1;
      for (int64_t d : v.shape) {
        elems *= static_cast<uint64_t>(d);
      }
      if (elems * bragg::engine::TensorDTypeSize(v.dtype) != v.bytes) {
        std::abort();
      }
    }
  }
  (void)bragg::engine::ParseModelConfig(std::string_view(reinterpret_cast<const char*>(data), size),
                                        "fuzz/config.json");
  return 0;
}
