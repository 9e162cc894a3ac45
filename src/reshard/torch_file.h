#pragma once

// torch.save archives: dtypes, and where each pickled tensor's bytes lie in the file.

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "reshard/pickle.h"
#include "reshard/zip.h"

namespace bragg::reshard {

// Most elements of one tensor (2^50; 8 bytes each stay below 2^53): larger counts in metadata
// are refused, so that no element or byte count overflows.
inline constexpr uint64_t kMaxElements = uint64_t{1} << 50;

enum class DType { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool };

int ElementSize(DType t);
// Safetensors' names: "F32", "BF16", ...
std::string_view SafetensorsDType(DType t);
// "torch.bfloat16" / "torch.BFloat16Storage" -> kBF16; InvalidArgument for anything else.
[[nodiscard]] Result<DType> DTypeFromTorchName(std::string_view name);

// One tensor of a torch.save archive: `shape` elements of `dtype` stored contiguously at
// [data_offset, data_offset + bytes) of the file the archive was read from.
struct TensorRef {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t data_offset = 0;
  uint64_t bytes = 0;
};

// A parsed torch.save archive: its pickle (data.pkl) and its storages.
// Move-only (owns the PickleDoc); immutable after Open, so readable from many threads.
class TorchArchive {
 public:
  // Reads the archive at [base, base + length) of `fd` (borrowed; pread only). `limits` bound
  // data.pkl (limits.max_input: its size, checked before it is read) and its parse. Errors: those
  // of ReadZipDirectory and ParsePickle, InvalidArgument when data.pkl is missing,
  // ResourceExhausted when it is larger than limits.max_input.
  [[nodiscard]] static Result<TorchArchive> Open(int fd, uint64_t base, uint64_t length,
                                                 const PickleLimits& limits = {});

  // Limits for the archive of one tensor chunk of a torch_dist checkpoint, whose data.pkl holds
  // one tensor: a few hundred bytes and a few dozen values in practice.
  static PickleLimits ChunkLimits();

  const PyValue* root() const { return doc_.root(); }

  // Resolves a pickled tensor (a _rebuild_tensor_v2 call, possibly wrapped in _rebuild_parameter)
  // to its bytes. InvalidArgument when `v` is not a tensor, its storage is missing, the tensor is
  // not contiguous or overruns its storage.
  [[nodiscard]] Result<TensorRef> Tensor(const PyValue* v) const;

  // True when `v` is a pickled tensor or parameter.
  static bool IsTensor(const PyValue* v);

 private:
  PickleDoc doc_;
  std::map<std::string, ZipEntry> storages_;
};

}  // namespace bragg::reshard
