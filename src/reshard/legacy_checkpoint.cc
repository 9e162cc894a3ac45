#include "reshard/legacy_checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>

#include <charconv>
#include <map>
#include <regex>
#include <set>
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
  bool two_fields = false;  // mp_rank_TT_XXX: XXX is the PP rank, or the EP rank when PP is 1
  std::string name;
};

// A rank, layer or expert index from a directory name or a tensor key: decimal digits up to
// kMaxIndex (a hostile key's 30-digit index is refused, not an exception or an overflow).
constexpr int64_t kMaxIndex = int64_t{1} << 24;

bool ParseIndex(std::string_view digits, int64_t* out) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v);
  if (ec != std::errc() || end != digits.data() + digits.size() || v < 0 || v > kMaxIndex) {
    return false;
  }
  *out = v;
  return true;
}

std::vector<RankDir> ListRankDirs(const std::string& dir) {
  std::vector<RankDir> out;
  UniqueDir d(::opendir(dir.c_str()));
  if (d == nullptr) {
    return out;
  }
  static const std::regex kRe(R"(mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?)");
  while (dirent* e = ::readdir(d.get())) {
    std::cmatch m;
    if (std::regex_match(e->d_name, m, kRe)) {
      RankDir r;
      r.name = e->d_name;
      int64_t tp = 0;
      int64_t pp = 0;
      int64_t ep = 0;
      if (!ParseIndex(m[1].str(), &tp) || (m[2].matched && !ParseIndex(m[2].str(), &pp)) ||
          (m[3].matched && !ParseIndex(m[3].str(), &ep))) {
        continue;  // not a rank directory Megatron could have written
      }
      r.tp = static_cast<int>(tp);
      r.pp = static_cast<int>(pp);
      r.two_fields = m[2].matched && !m[3].matched;
      r.ep = static_cast<int>(ep);
      out.push_back(r);
    }
  }
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
  // Column-parallel (output rows split): GQA linear_qkv, MLA's up projections and linear_q_proj
  // (MLA's down projections are replicated), embeddings and the output layer.
  if (ends("linear_qkv.weight") || ends("linear_qkv.bias") || ends("linear_q_proj.weight") ||
      ends("linear_q_up_proj.weight") || ends("linear_kv_up_proj.weight") ||
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

// One tensor of one rank file, its key parsed.
struct Entry {
  int pp = 0;
  int tp = 0;
  int ep = 0;
  std::string key;      // as saved (local layer index)
  std::string suffix;   // key without "decoder.layers.N." (the whole key for non-layer tensors)
  int64_t layer = -1;   // local layer index
  int64_t expert = -1;  // local expert index
  LocalTensor tensor;
};

// Expert weights under their torch_dist name: SequentialMLP's
// "mlp.experts.local_experts.K.linear_fcN.weight" and TEGroupedMLP's
// "mlp.experts.linear_fcN.weightK" -> "mlp.experts.experts.linear_fcN.weight", expert K.
Result<bool> ParseExpertSuffix(const std::string& rest, std::string* suffix, int64_t* expert) {
  static const std::regex kSequential(
      R"(mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight)");
  static const std::regex kGrouped(R"(mlp\.experts\.(linear_fc[12])\.weight(\d+))");
  std::smatch m;
  const bool sequential = std::regex_match(rest, m, kSequential);
  if (!sequential && !std::regex_match(rest, m, kGrouped)) {
    return false;
  }
  const std::string index = m[sequential ? 1 : 2].str();
  if (!ParseIndex(index, expert)) {
    return absl::InvalidArgumentError(fmt::format("{}: expert index {} out of range", rest, index));
  }
  *suffix = "mlp.experts.experts." + m[sequential ? 2 : 1].str() + ".weight";
  return true;
}

// A rank's model_optim_rng.pt, open: the archive reads through `fd` (borrowed), so both live
// together.
struct RankFile {
  UniqueFd fd;
  TorchArchive archive;
};

Result<RankFile> OpenRankFile(const std::string& path) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoError("fstat", path);
  }
  auto archive = TorchArchive::Open(fd.get(), 0, static_cast<uint64_t>(st.st_size));
  if (!archive.ok()) {
    return Annotate(archive.status(), path);
  }
  return RankFile{std::move(fd), *std::move(archive)};
}

// Megatron names rank directories mp_rank_TT[_PPP][_EEE], the PP part only with pipeline
// parallelism, so mp_rank_TT_XXX is ambiguous; the saved args say which parallelism it is.
// Returns true when `rel` (a model_optim_rng.pt) was saved without pipeline parallelism and
// with expert parallelism.
Result<bool> SavedWithExpertParallelOnly(const std::string& dir, const std::string& rel) {
  const std::string path = dir + "/" + rel;
  BRAGG_ASSIGN_OR_RETURN(RankFile file, OpenRankFile(path));
  const PyValue* root = file.archive.root();
  const PyValue* args = root != nullptr ? root->Get("args") : nullptr;
  auto size_of = [&](std::string_view name) -> int64_t {
    const PyValue* v = args != nullptr ? args->Get(name) : nullptr;
    return v != nullptr && v->kind == PyValue::Kind::kInt ? v->i : 1;
  };
  return size_of("pipeline_model_parallel_size") == 1 && size_of("expert_model_parallel_size") > 1;
}

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
  for (const RankDir& r : ranks) {
    if (r.two_fields) {
      BRAGG_ASSIGN_OR_RETURN(bool ep_only,
                             SavedWithExpertParallelOnly(dir, r.name + "/model_optim_rng.pt"));
      if (ep_only) {
        for (RankDir& x : ranks) {
          if (x.two_fields) {
            std::swap(x.pp, x.ep);
          }
        }
      }
      break;
    }
  }
  int tp_size = 0;
  int pp_size = 0;
  int ep_size = 0;
  for (const RankDir& r : ranks) {
    tp_size = std::max(tp_size, r.tp + 1);
    pp_size = std::max(pp_size, r.pp + 1);
    ep_size = std::max(ep_size, r.ep + 1);
  }
  static const std::regex kLayer(R"(decoder\.layers\.(\d+)\.(.+))");
  std::set<std::tuple<int, int, int>> present;
  std::vector<Entry> entries;
  for (const RankDir& r : ranks) {
    present.insert({r.pp, r.tp, r.ep});
    const std::string rel = r.name + "/model_optim_rng.pt";
    const std::string path = dir + "/" + rel;
    BRAGG_ASSIGN_OR_RETURN(RankFile file, OpenRankFile(path));
    const PyValue* model =
        file.archive.root() != nullptr ? file.archive.root()->Get("model") : nullptr;
    if (model == nullptr || model->kind != PyValue::Kind::kDict) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: no 'model' state dict (virtual pipeline 'model0' is not supported)", path));
    }
    for (const auto& [k, v] : model->dict) {
      BRAGG_ASSIGN_OR_RETURN(std::string key, AsStr(k, "state dict key"));
      if (!TorchArchive::IsTensor(v)) {
        continue;  // _extra_state and other non-tensors
      }
      Entry e;
      e.pp = r.pp;
      e.tp = r.tp;
      e.ep = r.ep;
      e.key = key;
      e.suffix = key;
      std::smatch m;
      if (std::regex_match(key, m, kLayer)) {
        if (!ParseIndex(m[1].str(), &e.layer)) {
          return absl::InvalidArgumentError(
              fmt::format("{} in {}: layer index out of range", key, path));
        }
        e.suffix = m[2].str();
        auto expert = ParseExpertSuffix(m[2].str(), &e.suffix, &e.expert);
        if (!expert.ok()) {
          return Annotate(expert.status(), path);
        }
      }
      if (e.expert < 0 && r.ep != 0) {
        continue;  // dense weights are replicated across expert-parallel ranks
      }
      auto ref = file.archive.Tensor(v);
      if (!ref.ok()) {
        return Annotate(ref.status(), fmt::format("{} in {}", key, path));
      }
      e.tensor = LocalTensor{rel, *ref};
      entries.push_back(std::move(e));
    }
  }
  for (int p = 0; p < pp_size; ++p) {
    for (int t = 0; t < tp_size; ++t) {
      for (int x = 0; x < ep_size; ++x) {
        if (present.count({p, t, x}) == 0) {
          return absl::InvalidArgumentError(
              ep_size > 1
                  ? fmt::format("{}: rank directory for tp={} pp={} ep={} is missing", dir, t, p, x)
                  : fmt::format("{}: rank directory for tp={} pp={} is missing", dir, t, p));
        }
      }
    }
  }
  // Layers per stage and local experts per layer, from the first TP/EP rank of each stage.
  std::vector<int64_t> stage_layers(pp_size, 0);
  std::map<std::pair<int, int64_t>, int64_t> local_experts;  // (stage, local layer) -> count
  for (const Entry& e : entries) {
    if (e.layer >= 0 && e.tp == 0 && e.ep == 0) {
      stage_layers[e.pp] = std::max(stage_layers[e.pp], e.layer + 1);
      if (e.expert >= 0) {
        int64_t& n = local_experts[{e.pp, e.layer}];
        n = std::max(n, e.expert + 1);
      }
    }
  }
  std::vector<int64_t> first_layer(pp_size, 0);
  int64_t total_layers = 0;
  for (int p = 0; p < pp_size; ++p) {
    first_layer[p] = total_layers;
    total_layers += stage_layers[p];
  }
  // Megatron stacks layers on a leading axis only when every layer holds the same tensors
  // (dense models); mixed dense/MoE layers keep per-layer keys, and so does this index.
  std::map<int64_t, std::set<std::string>> layer_suffixes;
  for (const Entry& e : entries) {
    if (e.layer >= 0 && e.tp == 0 && e.ep == 0) {
      layer_suffixes[first_layer[e.pp] + e.layer].insert(e.suffix);
    }
  }
  bool stacked = true;
  for (const auto& [layer, suffixes] : layer_suffixes) {
    stacked = stacked && suffixes == layer_suffixes.begin()->second;
  }
  CheckpointIndex out;
  out.dir = dir;
  for (const Entry& e : entries) {
    const Split split = SplitOf(e.suffix);
    if (split == Split::kReplicated && e.tp != 0) {
      continue;
    }
    const LocalTensor& lt = e.tensor;
    const std::vector<int64_t>& ls = lt.ref.shape;
    if ((split != Split::kReplicated && ls.empty()) || (split == Split::kCols && ls.size() < 2)) {
      return absl::InvalidArgumentError(
          fmt::format("{}: '{}' has shape [{}], which cannot be tensor-parallel", lt.file, e.key,
                      fmt::join(ls, ",")));
    }
    // Leading axes of one index each: the stacked layer axis, the expert axis.
    std::vector<int64_t> lead_index, lead_extent;
    std::string gkey = e.suffix;
    if (e.layer >= 0) {
      const int64_t global_layer = first_layer[e.pp] + e.layer;
      if (stacked) {
        gkey = "decoder.layers." + e.suffix;
        lead_index.push_back(global_layer);
        lead_extent.push_back(total_layers);
      } else {
        gkey = fmt::format("decoder.layers.{}.{}", global_layer, e.suffix);
      }
    }
    if (e.expert >= 0) {
      const int64_t per_rank = local_experts[{e.pp, e.layer}];
      lead_index.push_back(e.ep * per_rank + e.expert);
      lead_extent.push_back(per_rank * ep_size);
    }
    std::vector<int64_t> gshape = ls;
    std::vector<int64_t> base(ls.size(), 0);
    const size_t sd = split == Split::kCols ? 1 : 0;
    if (split != Split::kReplicated) {
      gshape[sd] = ls[sd] * tp_size;
      base[sd] = ls[sd] * e.tp;
    }
    gshape.insert(gshape.begin(), lead_extent.begin(), lead_extent.end());
    SourceTensor& g = out.tensors[gkey];
    if (g.key.empty()) {
      g.key = gkey;
      g.dtype = lt.ref.dtype;
      g.shape = gshape;
    } else if (g.shape != gshape || g.dtype != lt.ref.dtype) {
      return absl::InvalidArgumentError(
          fmt::format("{}: '{}' [{}] disagrees with other ranks ([{}] globally)", lt.file, e.key,
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
      c.offsets.insert(c.offsets.begin(), lead_index.begin(), lead_index.end());
      c.sizes.insert(c.sizes.begin(), lead_index.size(), 1);
      g.chunks.push_back(std::move(c));
    };
    if (split == Split::kGatedRows) {
      if (ls[0] % 2 != 0) {
        return absl::InvalidArgumentError(
            fmt::format("{}: gated '{}' has an odd number of rows", lt.file, e.key));
      }
      // Local [gate_t; up_t] -> global [gate_0 .. gate_n; up_0 .. up_n].
      const int64_t half = ls[0] / 2;
      add_chunk(0, half, e.tp * half);
      add_chunk(half, half, tp_size * half + e.tp * half);
    } else {
      add_chunk(0, ls.empty() ? 0 : ls[0], 0);
    }
  }
  for (auto& [key, t] : out.tensors) {
    BRAGG_RETURN_IF_ERROR(ValidateChunks(t));
  }
  return out;
}

}  // namespace bragg::reshard
