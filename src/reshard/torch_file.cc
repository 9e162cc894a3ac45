#include "reshard/torch_file.h"

#include <fmt/format.h>
#include <unistd.h>

namespace bragg::reshard {

int ElementSize(DType t) {
  switch (t) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
    case DType::kI16:
      return 2;
    case DType::kI8:
    case DType::kU8:
    case DType::kBool:
      return 1;
  }
  return 1;
}

std::string_view SafetensorsDType(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kF64:
      return "F64";
    case DType::kI64:
      return "I64";
    case DType::kI32:
      return "I32";
    case DType::kI16:
      return "I16";
    case DType::kI8:
      return "I8";
    case DType::kU8:
      return "U8";
    case DType::kBool:
      return "BOOL";
  }
  return "?";
}

Result<DType> DTypeFromTorchName(std::string_view name) {
  static const std::pair<std::string_view, DType> kNames[] = {
      {"torch.float32", DType::kF32},       {"torch.float", DType::kF32},
      {"torch.FloatStorage", DType::kF32},  {"torch.float16", DType::kF16},
      {"torch.half", DType::kF16},          {"torch.HalfStorage", DType::kF16},
      {"torch.bfloat16", DType::kBF16},     {"torch.BFloat16Storage", DType::kBF16},
      {"torch.float64", DType::kF64},       {"torch.double", DType::kF64},
      {"torch.DoubleStorage", DType::kF64}, {"torch.int64", DType::kI64},
      {"torch.long", DType::kI64},          {"torch.LongStorage", DType::kI64},
      {"torch.int32", DType::kI32},         {"torch.int", DType::kI32},
      {"torch.IntStorage", DType::kI32},    {"torch.int16", DType::kI16},
      {"torch.ShortStorage", DType::kI16},  {"torch.int8", DType::kI8},
      {"torch.CharStorage", DType::kI8},    {"torch.uint8", DType::kU8},
      {"torch.ByteStorage", DType::kU8},    {"torch.bool", DType::kBool},
      {"torch.BoolStorage", DType::kBool},
  };
  for (const auto& [n, t] : kNames) {
    if (n == name) {
      return t;
    }
  }
  return absl::InvalidArgumentError(fmt::format("unsupported torch dtype '{}'", name));
}

PickleLimits TorchArchive::ChunkLimits() {
  PickleLimits l;
  l.max_input = 1 << 20;
  l.max_values = 100'000;
  l.max_marks = 1'000;
  l.max_stack = 100'000;
  return l;
}

Result<TorchArchive> TorchArchive::Open(int fd, uint64_t base, uint64_t length,
                                        const PickleLimits& limits) {
  const uint64_t max_pickle = limits.max_input;
  BRAGG_ASSIGN_OR_RETURN(std::vector<ZipEntry> entries, ReadZipDirectory(fd, base, length));
  const ZipEntry* pkl = nullptr;
  std::string prefix;
  for (const ZipEntry& e : entries) {
    std::string_view n = e.name;
    size_t slash = n.find('/');
    if (slash != std::string_view::npos && n.substr(slash) == "/data.pkl") {
      pkl = &e;
      prefix = std::string(n.substr(0, slash));
      break;
    }
  }
  if (pkl == nullptr) {
    return absl::InvalidArgumentError("torch.save archive without <name>/data.pkl");
  }
  if (pkl->size > max_pickle) {
    return absl::ResourceExhaustedError(
        fmt::format("data.pkl of {} bytes exceeds the limit of {}", pkl->size, max_pickle));
  }
  std::string buf(pkl->size, '\0');
  size_t done = 0;
  while (done < buf.size()) {
    ssize_t r = ::pread(fd, buf.data() + done, buf.size() - done,
                        static_cast<off_t>(pkl->data_offset + done));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r < 0) {
      return ErrnoError("pread", "data.pkl");
    }
    if (r == 0) {
      return absl::InvalidArgumentError("file ends inside data.pkl");
    }
    done += static_cast<size_t>(r);
  }
  TorchArchive out;
  BRAGG_ASSIGN_OR_RETURN(out.doc_, ParsePickle(buf, limits));
  std::string data_prefix = prefix + "/data/";
  for (const ZipEntry& e : entries) {
    if (e.name.compare(0, data_prefix.size(), data_prefix) == 0) {
      out.storages_[e.name.substr(data_prefix.size())] = e;
    }
  }
  return out;
}

bool TorchArchive::IsTensor(const PyValue* v) {
  return v != nullptr && (v->IsObjectOf("torch._utils._rebuild_tensor_v2") ||
                          v->IsObjectOf("torch._utils._rebuild_parameter") ||
                          v->IsObjectOf("torch._utils._rebuild_parameter_with_state"));
}

Result<TensorRef> TorchArchive::Tensor(const PyValue* v) const {
  if (v != nullptr && (v->IsObjectOf("torch._utils._rebuild_parameter") ||
                       v->IsObjectOf("torch._utils._rebuild_parameter_with_state"))) {
    if (v->args == nullptr || v->args->items.empty()) {
      return absl::InvalidArgumentError("_rebuild_parameter without arguments");
    }
    v = v->args->items[0];
  }
  if (v == nullptr || !v->IsObjectOf("torch._utils._rebuild_tensor_v2") || v->args == nullptr ||
      v->args->items.size() < 4) {
    return absl::InvalidArgumentError(
        fmt::format("expected a pickled tensor, got {}", DescribeValue(v, 3)));
  }
  const auto& a = v->args->items;
  const PyValue* pid = a[0];
  if (pid->kind != PyValue::Kind::kPersistent || pid->args == nullptr ||
      pid->args->kind != PyValue::Kind::kTuple || pid->args->items.size() < 5) {
    return absl::InvalidArgumentError(
        fmt::format("tensor storage is not a persistent id: {}", DescribeValue(pid, 3)));
  }
  const auto& p = pid->args->items;
  BRAGG_ASSIGN_OR_RETURN(std::string tag, AsStr(p[0], "persistent id tag"));
  if (tag != "storage" || p[1]->kind != PyValue::Kind::kGlobal || !p[1]->allowed) {
    return absl::InvalidArgumentError(
        fmt::format("unsupported storage reference {}", DescribeValue(pid, 3)));
  }
  TensorRef t;
  BRAGG_ASSIGN_OR_RETURN(t.dtype, DTypeFromTorchName(p[1]->s));
  BRAGG_ASSIGN_OR_RETURN(std::string key, AsStr(p[2], "storage key"));
  BRAGG_ASSIGN_OR_RETURN(int64_t storage_offset, AsInt(a[1], "storage offset"));
  BRAGG_ASSIGN_OR_RETURN(t.shape, AsIntList(a[2], "tensor size"));
  BRAGG_ASSIGN_OR_RETURN(std::vector<int64_t> stride, AsIntList(a[3], "tensor stride"));
  if (stride.size() != t.shape.size()) {
    return absl::InvalidArgumentError("tensor size and stride differ in rank");
  }
  auto it = storages_.find(key);
  if (it == storages_.end()) {
    return absl::InvalidArgumentError(fmt::format("storage '{}' missing from the archive", key));
  }
  // Contiguous row-major: each stride is the product of the later dims (numel so far), which
  // is checked before it can overflow.
  uint64_t numel = 1;
  for (size_t d = t.shape.size(); d-- > 0;) {
    if (t.shape[d] < 0 || t.shape[d] > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError("tensor dimension out of range");
    }
    if (t.shape[d] != 1 && (stride[d] < 0 || static_cast<uint64_t>(stride[d]) != numel)) {
      return absl::InvalidArgumentError(
          fmt::format("non-contiguous tensor (size {}, stride {}) is not supported",
                      DescribeValue(a[2], 2), DescribeValue(a[3], 2)));
    }
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(t.shape[d]), &numel) ||
        numel > kMaxElements) {
      return absl::InvalidArgumentError(fmt::format("tensor of size {} has more than {} elements",
                                                    DescribeValue(a[2], 2), kMaxElements));
    }
  }
  const uint64_t es = ElementSize(t.dtype);
  if (storage_offset < 0 || static_cast<uint64_t>(storage_offset) > kMaxElements) {
    return absl::InvalidArgumentError("storage offset out of range");
  }
  t.bytes = numel * es;
  uint64_t start = static_cast<uint64_t>(storage_offset) * es;
  if (start > it->second.size || t.bytes > it->second.size - start) {
    return absl::InvalidArgumentError(
        fmt::format("tensor of {} bytes at element {} overruns its storage '{}' of {} bytes",
                    t.bytes, storage_offset, key, it->second.size));
  }
  t.data_offset = it->second.data_offset + start;
  return t;
}

}  // namespace bragg::reshard
