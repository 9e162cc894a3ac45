#include "reshard/dist_checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>

#include "common/fs.h"
#include "common/unique_fd.h"
#include "reshard/pickle.h"

namespace bragg::reshard {

namespace {

bool IsMetaClass(const PyValue* v, std::string_view cls) {
  return v->IsObjectOf(fmt::format("torch.distributed.checkpoint.metadata.{}", cls)) ||
         v->IsObjectOf(fmt::format("torch.distributed._shard.checkpoint.metadata.{}", cls));
}

bool IsStorageInfo(const PyValue* v) {
  return v->IsObjectOf("torch.distributed.checkpoint.filesystem._StorageInfo") ||
         v->IsObjectOf("torch.distributed._shard.checkpoint.filesystem._StorageInfo");
}

// Fails on a non-empty transform_descriptors field (newer PyTorch compresses chunks that way).
Status CheckNoTransforms(const PyValue* obj, std::string_view key) {
  const PyValue* t = obj->Get("transform_descriptors");
  if (t != nullptr && !t->IsNone() && !(t->kind == PyValue::Kind::kList && t->items.empty()) &&
      !(t->kind == PyValue::Kind::kTuple && t->items.empty())) {
    return absl::UnimplementedError(fmt::format(
        "'{}' has transform_descriptors {}: transformed (e.g. compressed) chunks are not "
        "supported; save the checkpoint without transforms",
        key, DescribeValue(t, 3)));
  }
  return absl::OkStatus();
}

Result<DType> PropertiesDType(const PyValue* props, const std::string& key) {
  const PyValue* dtype = nullptr;
  if (props != nullptr && props->kind == PyValue::Kind::kObject && props->state != nullptr) {
    if (props->state->kind == PyValue::Kind::kTuple && !props->state->items.empty()) {
      dtype = props->state->items[0];  // __getstate__ tuple: (dtype, layout, requires_grad, ...)
    } else {
      dtype = props->Get("dtype");
    }
  }
  if (dtype == nullptr || dtype->kind != PyValue::Kind::kGlobal) {
    return absl::InvalidArgumentError(
        fmt::format("'{}': tensor properties without a dtype: {}", key, DescribeValue(props, 3)));
  }
  return DTypeFromTorchName(dtype->s);
}

std::string OffsetsKey(const std::string& fqn, const std::vector<int64_t>& offsets) {
  std::string k = fqn;
  for (int64_t o : offsets) {
    k += fmt::format("|{}", o);
  }
  return k;
}

// Reads .metadata whole after checking its size, so that a huge file is refused before any of
// it is in memory.
Result<std::string> ReadMetadataFile(const std::string& path) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoError("fstat", path);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > kMaxMetadataBytes) {
    return absl::ResourceExhaustedError(
        fmt::format("{} is {} bytes, more than the limit of {}: not a checkpoint's metadata", path,
                    size, kMaxMetadataBytes));
  }
  std::string bytes(size, '\0');
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n =
        ::pread(fd.get(), bytes.data() + done, bytes.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      return ErrnoError("pread", path);
    }
    if (n == 0) {
      break;  // shrank meanwhile: parsed as it is, a truncated pickle fails cleanly
    }
    done += static_cast<size_t>(n);
  }
  bytes.resize(done);
  return bytes;
}

}  // namespace

std::string ResolveIterationDir(const std::string& dir) {
  auto it = ReadFileToString(dir + "/latest_checkpointed_iteration.txt");
  if (!it.ok()) {
    return dir;
  }
  std::string s = *it;
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) {
    s.pop_back();
  }
  // Megatron writes "release" for a released (converted) checkpoint, in directory "release".
  if (s == "release") {
    return dir + "/release";
  }
  int64_t n = -1;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || n < 0) {
    return dir;
  }
  return fmt::format("{}/iter_{:07d}", dir, n);
}

PickleLimits MetadataLimits(uint64_t size) {
  PickleLimits l;
  l.max_input = kMaxMetadataBytes;
  // Every opcode that makes a value takes at least one byte (so this only documents the tie to
  // the size); a real .metadata has one opcode per 2.5 bytes (the fixtures'), each making at
  // most one value.
  l.max_values = std::min<uint64_t>(50'000'000, 4096 + size);
  // Python's pickler pushes at most 1000 items between a MARK and the op that takes them.
  l.max_stack = 1'000'000;
  l.max_marks = 10'000;
  return l;
}

bool IsNonModelStateKey(std::string_view key) {
  auto starts = [&](std::string_view p) { return key.substr(0, p.size()) == p; };
  // ChainedOptimizer prefixes the state of its i-th optimizer with "chained_<i>.".
  if (starts("chained_")) {
    size_t k = 8;
    while (k < key.size() && key[k] >= '0' && key[k] <= '9') {
      ++k;
    }
    if (k > 8 && k < key.size() && key[k] == '.') {
      key.remove_prefix(k + 1);
    }
  }
  auto object = [&](std::string_view name) {
    return starts(name) &&
           (key.size() == name.size() || key[name.size()] == '/' || key[name.size()] == '.');
  };
  return starts("optimizer.") || object("rng_state") || object("rerun_state_machine_state");
}

uint64_t NumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t s : shape) {
    n *= static_cast<uint64_t>(s);
  }
  return n;
}

Result<uint64_t> CheckedNumElements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) {
      return absl::InvalidArgumentError(fmt::format("negative dimension {}", s));
    }
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(s), &n) || n > kMaxElements) {
      return absl::InvalidArgumentError(
          fmt::format("shape [{}] has more than {} elements", fmt::join(shape, ","), kMaxElements));
    }
  }
  return n;
}

Status ValidateChunks(const SourceTensor& t) {
  const size_t rank = t.shape.size();
  for (int64_t s : t.shape) {
    if (s < 0 || s > (int64_t{1} << 40)) {
      return absl::InvalidArgumentError(fmt::format("'{}': dimension {} out of range", t.key, s));
    }
  }
  // Checked first: a product that wraps (two dims of 2^32 are 2^64 = 0 elements) would let an
  // empty chunk list "cover" the tensor. Every chunk lies inside the shape (checked below), so
  // its product is bounded too, and the sum of non-overlapping chunks by the shape's.
  if (auto n = CheckedNumElements(t.shape); !n.ok()) {
    return Annotate(n.status(), fmt::format("'{}'", t.key));
  }
  uint64_t covered = 0;
  for (size_t c = 0; c < t.chunks.size(); ++c) {
    const SourceChunk& ch = t.chunks[c];
    if (ch.offsets.size() != rank || ch.sizes.size() != rank) {
      return absl::InvalidArgumentError(
          fmt::format("'{}': chunk {} has rank {} but the tensor has rank {}", t.key, c,
                      ch.offsets.size(), rank));
    }
    for (size_t d = 0; d < rank; ++d) {
      if (ch.offsets[d] < 0 || ch.sizes[d] < 0 || ch.offsets[d] > t.shape[d] ||
          ch.sizes[d] > t.shape[d] - ch.offsets[d]) {
        return absl::InvalidArgumentError(fmt::format(
            "'{}': chunk {} ([{}] + [{}]) lies outside the global shape [{}]", t.key, c,
            fmt::join(ch.offsets, ","), fmt::join(ch.sizes, ","), fmt::join(t.shape, ",")));
      }
    }
    covered += NumElements(ch.sizes);
  }
  // Pairwise overlap check; chunk counts per key are small (TP x PP x EP).
  for (size_t a = 0; a < t.chunks.size(); ++a) {
    for (size_t b = a + 1; b < t.chunks.size(); ++b) {
      bool overlap = NumElements(t.chunks[a].sizes) > 0 && NumElements(t.chunks[b].sizes) > 0;
      for (size_t d = 0; d < rank && overlap; ++d) {
        int64_t lo = std::max(t.chunks[a].offsets[d], t.chunks[b].offsets[d]);
        int64_t hi = std::min(t.chunks[a].offsets[d] + t.chunks[a].sizes[d],
                              t.chunks[b].offsets[d] + t.chunks[b].sizes[d]);
        overlap = lo < hi;
      }
      if (overlap) {
        return absl::InvalidArgumentError(
            fmt::format("'{}': chunks {} and {} overlap", t.key, a, b));
      }
    }
  }
  if (covered != NumElements(t.shape)) {
    return absl::InvalidArgumentError(
        fmt::format("'{}': chunks cover {} of {} elements (the checkpoint is incomplete)", t.key,
                    covered, NumElements(t.shape)));
  }
  return absl::OkStatus();
}

Result<CheckpointIndex> ReadDistCheckpointIndex(const std::string& dir) {
  const std::string path = dir + "/.metadata";
  BRAGG_ASSIGN_OR_RETURN(std::string bytes, ReadMetadataFile(path));
  auto parsed = ParsePickle(bytes, MetadataLimits(bytes.size()));
  if (!parsed.ok()) {
    return Annotate(parsed.status(), path);
  }
  PickleDoc doc = *std::move(parsed);
  auto bad = [&](std::string_view what) {
    return absl::InvalidArgumentError(fmt::format("{}: {}", path, what));
  };
  const PyValue* meta = doc.root();
  if (!IsMetaClass(meta, "Metadata")) {
    return bad(
        fmt::format("not a distributed-checkpoint Metadata object: {}", DescribeValue(meta, 2)));
  }
  const PyValue* sdm = meta->Get("state_dict_metadata");
  const PyValue* sd = meta->Get("storage_data");
  if (sdm == nullptr || sdm->kind != PyValue::Kind::kDict) {
    return bad("state_dict_metadata missing");
  }
  if (sd == nullptr || sd->kind != PyValue::Kind::kDict) {
    return bad("storage_data missing (was this checkpoint written by FileSystemWriter?)");
  }
  // storage_data: MetadataIndex(fqn, offset, index) -> _StorageInfo(relative_path, offset, length)
  std::map<std::string, SourceChunk> where;
  for (const auto& [k, v] : sd->dict) {
    if (!IsMetaClass(k, "MetadataIndex") || !IsStorageInfo(v)) {
      return bad(fmt::format("unexpected storage_data entry {} -> {}", DescribeValue(k, 2),
                             DescribeValue(v, 2)));
    }
    BRAGG_ASSIGN_OR_RETURN(std::string fqn, AsStr(k->Get("fqn"), "MetadataIndex.fqn"));
    const PyValue* off = k->Get("offset");
    std::vector<int64_t> offsets;
    if (off != nullptr && !off->IsNone()) {
      BRAGG_ASSIGN_OR_RETURN(offsets, AsIntList(off, "MetadataIndex.offset"));
    }
    BRAGG_RETURN_IF_ERROR(CheckNoTransforms(v, fqn));
    SourceChunk c;
    BRAGG_ASSIGN_OR_RETURN(c.file, AsStr(v->Get("relative_path"), "_StorageInfo.relative_path"));
    BRAGG_ASSIGN_OR_RETURN(int64_t o, AsInt(v->Get("offset"), "_StorageInfo.offset"));
    BRAGG_ASSIGN_OR_RETURN(int64_t l, AsInt(v->Get("length"), "_StorageInfo.length"));
    if (o < 0 || l < 0 || c.file.empty() || c.file.find('/') != std::string::npos ||
        c.file == "." || c.file == "..") {
      return bad(fmt::format("bad storage info for '{}': '{}' at {} (+{})", fqn, c.file, o, l));
    }
    c.archive_offset = static_cast<uint64_t>(o);
    c.archive_length = static_cast<uint64_t>(l);
    where[OffsetsKey(fqn, offsets)] = std::move(c);
  }
  CheckpointIndex out;
  out.dir = dir;
  for (const auto& [k, v] : sdm->dict) {
    BRAGG_ASSIGN_OR_RETURN(std::string fqn, AsStr(k, "state_dict_metadata key"));
    if (IsMetaClass(v, "BytesStorageMetadata")) {
      out.byte_items.push_back(fqn);
      continue;
    }
    if (IsNonModelStateKey(fqn)) {
      // Never read, so neither validated: an optimizer's flat buffers or a dtype without a
      // safetensors name must not stop the model's conversion.
      SkippedTensor s;
      s.key = fqn;
      if (IsMetaClass(v, "TensorStorageMetadata")) {
        auto dtype = PropertiesDType(v->Get("properties"), fqn);
        s.dtype = dtype.ok() ? std::string(SafetensorsDType(*dtype)) : "?";
        auto shape = AsIntList(v->Get("size"), fqn);
        if (shape.ok()) {
          s.shape = *std::move(shape);
        }
        const PyValue* chunks = v->Get("chunks");
        s.chunks =
            chunks != nullptr && chunks->kind == PyValue::Kind::kList ? chunks->items.size() : 0;
      }
      out.non_model.push_back(std::move(s));
      continue;
    }
    if (!IsMetaClass(v, "TensorStorageMetadata")) {
      return bad(fmt::format("'{}': unknown storage metadata {}", fqn, DescribeValue(v, 2)));
    }
    SourceTensor t;
    t.key = fqn;
    BRAGG_ASSIGN_OR_RETURN(t.dtype, PropertiesDType(v->Get("properties"), fqn));
    BRAGG_ASSIGN_OR_RETURN(t.shape, AsIntList(v->Get("size"), fqn + " size"));
    const PyValue* chunks = v->Get("chunks");
    if (chunks == nullptr || chunks->kind != PyValue::Kind::kList) {
      return bad(fmt::format("'{}': chunks missing", fqn));
    }
    for (const PyValue* c : chunks->items) {
      if (!IsMetaClass(c, "ChunkStorageMetadata")) {
        return bad(fmt::format("'{}': unexpected chunk {}", fqn, DescribeValue(c, 2)));
      }
      BRAGG_ASSIGN_OR_RETURN(std::vector<int64_t> offsets,
                             AsIntList(c->Get("offsets"), fqn + " chunk offsets"));
      BRAGG_ASSIGN_OR_RETURN(std::vector<int64_t> sizes,
                             AsIntList(c->Get("sizes"), fqn + " chunk sizes"));
      auto it = where.find(OffsetsKey(fqn, offsets));
      if (it == where.end()) {
        return bad(
            fmt::format("'{}': chunk at [{}] has no storage info", fqn, fmt::join(offsets, ",")));
      }
      SourceChunk sc = it->second;
      sc.offsets = std::move(offsets);
      sc.sizes = std::move(sizes);
      t.chunks.push_back(std::move(sc));
    }
    BRAGG_RETURN_IF_ERROR(ValidateChunks(t));
    out.tensors[fqn] = std::move(t);
  }
  return out;
}

}  // namespace bragg::reshard
