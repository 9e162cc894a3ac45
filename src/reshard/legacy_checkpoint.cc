#include "reshard/legacy_checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <map>
#include <regex>
#include <tuple>

#include "common/fs.h"
#include "common/unique_fd.h"
#include "reshard/torch_file.h"

namespace bragg::reshard {

namespace {

struct RankDir {
  int tp = 0;
  int pp = 0;
  int ep = 0;
  std::string name;
};

// Follows latest_checkpointed_iteration.txt to iter_XXXXXXX when present.
std::string ResolveIterationDir(const std::string& dir) {
  auto it = ReadFileToString(dir + "/latest_checkpointed_iteration.txt");
  if (!it.ok()) {
    return dir;
  }
  std::string s = *it;
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) {
    s.pop_back();
  }
  char* end = nullptr;
  long n = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || n < 0) {
    return dir;
  }
  return fmt::format("{}/iter_{:07d}", dir, n);
}

std::vector<RankDir> ListRankDirs(const std::string& dir) {
  std::vector<RankDir> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return out;
  }
  static const std::regex kRe(R"(mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?)");
  while (dirent* e = ::readdir(d)) {
    std::cmatch m;
    if (std::regex_match(e->d_name, m, kRe)) {
      RankDir r;
      r.name = e->d_name;
      r.tp = std::stoi(m[1].str());
      if (m[2].matched) {
        r.pp = std::stoi(m[2].str());
      }
      if (m[3].matched) {
        r.ep = std::stoi(m[3].str());
      }
      out.push_back(r);
    }
  }
  ::closedir(d);
  return out;
}

enum class Split { kReplicated, kRows, kCols, kGatedRows };

Split SplitOf(const std::string& key) {
  auto ends = [&](std::string_view s) {
    return key.size() >= s.size() && key.compare(key.size() - s.size(), s.size(), s) == 0;
  };
  if (ends("linear_fc1.weight") || ends("linear_fc1.bias")) {
    return Split::kGatedRows;
  }
  if (ends("linear_qkv.weight") || ends("linear_qkv.bias") ||
      key == "embedding.word_embeddings.weight" || key == "output_layer.weight") {
    return Split::kRows;
  }
  if (ends("linear_proj.weight") || ends("linear_fc2.weight")) {
    return Split::kCols;
  }
  return Split::kReplicated;
}

struct LocalTensor {
  std::string file;
  TensorRef ref;
};

}  // namespace

bool IsLegacyCheckpoint(const std::string& dir) {
  return !ListRankDirs(ResolveIterationDir(dir)).empty();
}

Result<CheckpointIndex> ReadLegacyCheckpointIndex(const std::string& top) {
  const std::string dir = ResolveIterationDir(top);
  std::vector<RankDir> ranks = ListRankDirs(dir);
  if (ranks.empty()) {
    return absl::NotFoundError(
        fmt::format("{}: neither .metadata (torch_dist) nor mp_rank_* directories (legacy)", dir));
  }
  int tp_size = 0;
  int pp_size = 0;
  for (const RankDir& r : ranks) {
    tp_size = std::max(tp_size, r.tp + 1);
    pp_size = std::max(pp_size, r.pp + 1);
  }
  // (pp, tp) -> local key -> tensor; only EP rank 0 (dense weights are replicated across EP).
  std::map<std::pair<int, int>, std::map<std::string, LocalTensor>> local;
  for (const RankDir& r : ranks) {
    if (r.ep != 0) {
      continue;
    }
    const std::string rel = r.name + "/model_optim_rng.pt";
    const std::string path = dir + "/" + rel;
    BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
    struct stat st;
    if (::fstat(fd.get(), &st) != 0) {
      return ErrnoError("fstat", path);
    }
    auto archive = TorchArchive::Open(fd.get(), 0, static_cast<uint64_t>(st.st_size));
    if (!archive.ok()) {
      return Annotate(archive.status(), path);
    }
    const PyValue* model = archive->root() != nullptr ? archive->root()->Get("model") : nullptr;
    if (model == nullptr || model->kind != PyValue::Kind::kDict) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: no 'model' state dict (virtual pipeline 'model0' is not supported)", path));
    }
    auto& m = local[{r.pp, r.tp}];
    for (const auto& [k, v] : model->dict) {
      BRAGG_ASSIGN_OR_RETURN(std::string key, AsStr(k, "state dict key"));
      if (!TorchArchive::IsTensor(v)) {
        continue;  // _extra_state and other non-tensors
      }
      auto ref = archive->Tensor(v);
      if (!ref.ok()) {
        return Annotate(ref.status(), fmt::format("{} in {}", key, path));
      }
      m[key] = LocalTensor{rel, *ref};
    }
  }
  for (int p = 0; p < pp_size; ++p) {
    for (int t = 0; t < tp_size; ++t) {
      if (local.count({p, t}) == 0) {
        return absl::InvalidArgumentError(
            fmt::format("{}: rank directory for tp={} pp={} is missing", dir, t, p));
      }
    }
  }
  // Layers per stage from the local keys.
  static const std::regex kLayer(R"(decoder\.layers\.(\d+)\.(.+))");
  std::vector<int64_t> stage_layers(pp_size, 0);
  for (int p = 0; p < pp_size; ++p) {
    for (const auto& [key, lt] : local[{p, 0}]) {
      std::smatch m;
      if (std::regex_match(key, m, kLayer)) {
        stage_layers[p] = std::max<int64_t>(stage_layers[p], std::stoll(m[1].str()) + 1);
      }
    }
  }
  std::vector<int64_t> first_layer(pp_size, 0);
  int64_t total_layers = 0;
  for (int p = 0; p < pp_size; ++p) {
    first_layer[p] = total_layers;
    total_layers += stage_layers[p];
  }
  CheckpointIndex out;
  out.dir = dir;
  for (int p = 0; p < pp_size; ++p) {
    for (int t = 0; t < tp_size; ++t) {
      for (const auto& [key, lt] : local[{p, t}]) {
        std::string gkey = key;
        int64_t layer = -1;
        std::smatch m;
        if (std::regex_match(key, m, kLayer)) {
          layer = first_layer[p] + std::stoll(m[1].str());
          gkey = "decoder.layers." + m[2].str();
        }
        const Split split = SplitOf(gkey);
        if (split == Split::kReplicated && t != 0) {
          continue;
        }
        const std::vector<int64_t>& ls = lt.ref.shape;
        if ((split != Split::kReplicated && ls.empty()) ||
            (split == Split::kCols && ls.size() < 2)) {
          return absl::InvalidArgumentError(
              fmt::format("{}: '{}' has shape [{}], which cannot be tensor-parallel", lt.file, key,
                          fmt::join(ls, ",")));
        }
        std::vector<int64_t> gshape = ls;
        std::vector<int64_t> base(ls.size(), 0);
        const size_t sd = split == Split::kCols ? 1 : 0;
        if (split != Split::kReplicated) {
          gshape[sd] = ls[sd] * tp_size;
          base[sd] = ls[sd] * t;
        }
        if (layer >= 0) {
          gshape.insert(gshape.begin(), total_layers);
        }
        SourceTensor& g = out.tensors[gkey];
        if (g.key.empty()) {
          g.key = gkey;
          g.dtype = lt.ref.dtype;
          g.shape = gshape;
        } else if (g.shape != gshape || g.dtype != lt.ref.dtype) {
          return absl::InvalidArgumentError(
              fmt::format("{}: '{}' [{}] disagrees with other ranks ([{}] globally)", lt.file, key,
                          fmt::join(ls, ","), fmt::join(g.shape, ",")));
        }
        auto add_chunk = [&](int64_t row_begin, int64_t rows, int64_t global_row) {
          SourceChunk c;
          c.file = lt.file;
          c.resolved = true;
          uint64_t row_bytes = ElementSize(lt.ref.dtype);
          for (size_t d = 1; d < ls.size(); ++d) {
            row_bytes *= static_cast<uint64_t>(ls[d]);
          }
          c.data_offset = lt.ref.data_offset + static_cast<uint64_t>(row_begin) * row_bytes;
          c.offsets = base;
          c.sizes = ls;
          if (!ls.empty()) {
            c.sizes[0] = rows;
            if (split == Split::kGatedRows) {
              c.offsets[0] = global_row;
            }
          }
          if (layer >= 0) {
            c.offsets.insert(c.offsets.begin(), layer);
            c.sizes.insert(c.sizes.begin(), 1);
          }
          g.chunks.push_back(std::move(c));
        };
        if (split == Split::kGatedRows) {
          if (ls[0] % 2 != 0) {
            return absl::InvalidArgumentError(
                fmt::format("{}: gated '{}' has an odd number of rows", lt.file, key));
          }
          // Local [gate_t; up_t] -> global [gate_0 .. gate_n; up_0 .. up_n].
          const int64_t half = ls[0] / 2;
          add_chunk(0, half, t * half);
          add_chunk(half, half, tp_size * half + t * half);
        } else {
          add_chunk(0, ls.empty() ? 0 : ls[0], 0);
        }
      }
    }
  }
  for (auto& [key, t] : out.tensors) {
    BRAGG_RETURN_IF_ERROR(ValidateChunks(t));
  }
  return out;
}

}  // namespace bragg::reshard
