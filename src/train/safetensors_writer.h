#pragma once

// Writes safetensors files (the format bragg-engine, transformers and bragg-reshard read) and
// publishes directories of them atomically: a reader sees the old checkpoint or the new one,
// never half of one, whatever instant the writer dies at. Torch-free.

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/model/checkpoint.h"

namespace bragg::train {

struct TensorBytes {
  std::string name;
  engine::TensorDType dtype = engine::TensorDType::kF32;
  std::vector<int64_t> shape;
  std::span<const uint8_t> data;  // dtype size x shape's product bytes; borrowed
};

// Writes `tensors` (in the given order; names unique) to `path`: header, then each tensor's bytes
// straight from its buffer (no staging copy), then fsync. InvalidArgument on a size that does not
// match dtype x shape or a duplicate name; the errno of a failed write otherwise.
Status WriteSafetensors(const std::string& path, std::span<const TensorBytes> tensors,
                        const std::map<std::string, std::string>& metadata = {});

// Makes the finished directory `staging` (same file system) appear as `final_dir`: fsyncs it,
// renames it into place (an existing `final_dir` is exchanged with it atomically, then removed
// from the staging name) and fsyncs the parent. A crash leaves `final_dir` whole, old or new.
Status PublishDirectory(const std::string& staging, const std::string& final_dir);

}  // namespace bragg::train
