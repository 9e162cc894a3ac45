#pragma once

// Test helper: a source tensor cut into equal chunks, as a sharded checkpoint lists it.

#include <string>
#include <vector>

#include "reshard/dist_checkpoint.h"

namespace bragg::reshard::testing {

// Splits a global shape into chunks: `splits[d]` equal parts along dim d.
inline SourceTensor Chunked(const std::string& key, std::vector<int64_t> shape,
                            const std::vector<int>& splits) {
  SourceTensor t;
  t.key = key;
  t.dtype = DType::kF32;
  t.shape = shape;
  std::vector<int> idx(shape.size(), 0);
  while (true) {
    SourceChunk c;
    for (size_t d = 0; d < shape.size(); ++d) {
      int64_t n = shape[d] / splits[d];
      c.offsets.push_back(idx[d] * n);
      c.sizes.push_back(n);
    }
    t.chunks.push_back(c);
    size_t d = shape.size();
    while (d > 0) {
      --d;
      if (++idx[d] < splits[d]) {
        break;
      }
      idx[d] = 0;
      if (d == 0) {
        return t;
      }
    }
    if (shape.empty()) {
      return t;
    }
  }
}

}  // namespace bragg::reshard::testing
