#include "reshard/plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

namespace bragg::reshard {

namespace {

std::vector<uint64_t> RowMajorStrides(const std::vector<int64_t>& shape) {
  std::vector<uint64_t> s(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) {
    s[d - 1] = s[d] * static_cast<uint64_t>(shape[d]);
  }
  return s;
}

// Appends the runs that move the part of `chunk` selected by `m` (segment `seg`, whose first row
// lands on output row `out_row_base`) into the output tensor at byte `tensor_offset`.
void AddRuns(const SourceTensor& src, const SourceChunk& chunk, const TensorMapping& m,
             const RowSegment& seg, int64_t out_row_base, uint64_t tensor_offset,
             std::vector<CopyRun>* runs) {
  const size_t rank = src.shape.size();
  const size_t rdim = m.FixedAxes();
  std::vector<int64_t> lo(rank), hi(rank);
  for (size_t d = 0; d < rank; ++d) {
    int64_t a = 0;
    int64_t b = src.shape[d];
    if (d < rdim) {
      a = m.FixedIndex(d);
      b = a + 1;
    } else if (d == rdim) {
      a = seg.start;
      b = seg.start + seg.count;
    }
    lo[d] = std::max(a, chunk.offsets[d]);
    hi[d] = std::min(b, chunk.offsets[d] + chunk.sizes[d]);
    if (lo[d] >= hi[d]) {
      return;
    }
  }
  const uint64_t es = ElementSize(src.dtype);
  const std::vector<uint64_t> cs = RowMajorStrides(chunk.sizes);
  const std::vector<uint64_t> os = RowMajorStrides(m.hf_shape);
  size_t first = rank - 1;
  uint64_t elems = static_cast<uint64_t>(hi[first] - lo[first]);
  while (first > rdim && hi[first] - lo[first] == chunk.sizes[first] &&
         hi[first] - lo[first] == src.shape[first]) {
    --first;
    elems *= static_cast<uint64_t>(hi[first] - lo[first]);
  }
  std::vector<int64_t> idx(lo.begin(), lo.end());
  while (true) {
    uint64_t s = 0;
    uint64_t t = 0;
    for (size_t d = 0; d < rank; ++d) {
      s += static_cast<uint64_t>(idx[d] - chunk.offsets[d]) * cs[d];
      if (d == rdim) {
        t += static_cast<uint64_t>(out_row_base + idx[d] - seg.start) * os[0];
      } else if (d > rdim) {
        t += static_cast<uint64_t>(idx[d]) * os[d - rdim];
      }
    }
    runs->push_back(CopyRun{s * es, tensor_offset + t * es, elems * es});
    // Odometer over dims [rdim, first).
    size_t d = first;
    while (d > rdim) {
      --d;
      if (++idx[d] < hi[d]) {
        break;
      }
      idx[d] = lo[d];
      if (d == rdim) {
        return;
      }
    }
    if (first == rdim) {
      return;
    }
  }
}

Status CheckShapes(const SourceTensor& src, const TensorMapping& m, const ModelConfig& cfg) {
  const size_t rdim = m.FixedAxes();
  auto bad = [&](std::string_view what) {
    return absl::InvalidArgumentError(
        fmt::format("'{}' (from '{}' of shape [{}]): {}; does --model/config.json match the "
                    "checkpoint?",
                    m.hf_name, src.key, fmt::join(src.shape, ","), what));
  };
  if (src.shape.size() <= rdim) {
    return bad("source has too few dimensions");
  }
  if (m.layer >= 0 && src.shape[0] != cfg.num_layers) {
    return bad(fmt::format("stacked layer axis is {} but num_hidden_layers is {}", src.shape[0],
                           cfg.num_layers));
  }
  const size_t expert_axis = m.layer >= 0 ? 1 : 0;
  if (m.expert >= 0 && src.shape[expert_axis] != cfg.num_experts) {
    return bad(fmt::format("expert axis is {} but the config has {} experts",
                           src.shape[expert_axis], cfg.num_experts));
  }
  if (src.shape.size() - rdim != m.hf_shape.size()) {
    return bad(fmt::format("rank differs from the expected [{}]", fmt::join(m.hf_shape, ",")));
  }
  int64_t rows = 0;
  for (const RowSegment& s : m.segments) {
    if (s.start < 0 || s.count < 0 || s.start + s.count > src.shape[rdim]) {
      return bad(fmt::format("rows [{}, {}) lie outside the source", s.start, s.start + s.count));
    }
    rows += s.count;
  }
  if (m.segments.empty()) {
    rows = src.shape[rdim];
  }
  if (rows != m.hf_shape[0]) {
    return bad(fmt::format("{} rows selected but [{}] expected", rows, fmt::join(m.hf_shape, ",")));
  }
  for (size_t d = 1; d < m.hf_shape.size(); ++d) {
    if (src.shape[rdim + d] != m.hf_shape[d]) {
      return bad(fmt::format("expected [{}]", fmt::join(m.hf_shape, ",")));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Result<Plan> BuildPlan(const CheckpointIndex& index, const ModelConfig& cfg,
                       uint64_t max_shard_size) {
  std::vector<TensorMapping> maps = BuildMappings(cfg);
  std::set<std::string> names;
  std::set<std::string> used;
  Plan plan;
  std::vector<std::vector<PlannedTensor>> shards(1);
  uint64_t cur = 0;
  for (TensorMapping& m : maps) {
    if (!names.insert(m.hf_name).second) {
      return absl::InvalidArgumentError(fmt::format("duplicate output tensor '{}'", m.hf_name));
    }
    // The names the tensor may have, in order: its key, then (layer tensors) Megatron's
    // per-layer key (MoE and mixed dense/MoE models: no stacked layer axis), then the same for
    // the alternative key.
    std::vector<std::pair<std::string, bool>> names_tried;  // (key, per layer)
    for (const std::string* key : {&m.src_key, &m.alt_src_key}) {
      if (key->empty()) {
        continue;
      }
      names_tried.emplace_back(*key, false);
      if (m.layer >= 0) {
        names_tried.emplace_back(PerLayerKey(*key, m.layer), true);
      }
    }
    auto it = index.tensors.end();
    for (const auto& [key, per_layer] : names_tried) {
      it = index.tensors.find(key);
      if (it != index.tensors.end()) {
        m.src_key = key;
        if (per_layer) {
          m.layer = -1;
        }
        break;
      }
    }
    if (it == index.tensors.end()) {
      std::vector<std::string> quoted;
      for (const auto& tried : names_tried) {
        quoted.push_back("'" + tried.first + "'");
      }
      return absl::InvalidArgumentError(
          fmt::format("checkpoint has no {} (needed for '{}'); does --model match the checkpoint?",
                      fmt::join(quoted, " or "), m.hf_name));
    }
    BRAGG_RETURN_IF_ERROR(CheckShapes(it->second, m, cfg));
    used.insert(m.src_key);
    PlannedTensor t;
    t.dtype = it->second.dtype;
    t.bytes = NumElements(m.hf_shape) * ElementSize(t.dtype);
    t.map = std::move(m);
    if (cur > 0 && cur + t.bytes > max_shard_size) {
      shards.emplace_back();
      cur = 0;
    }
    cur += t.bytes;
    plan.total_bytes += t.bytes;
    shards.back().push_back(std::move(t));
  }
  for (const auto& [key, t] : index.tensors) {
    const bool mtp = key.compare(0, 4, "mtp.") == 0;
    if (mtp && !cfg.skip_mtp && used.count(key) == 0) {
      return absl::InvalidArgumentError(fmt::format(
          "checkpoint tensor '{}' belongs to a multi-token-prediction layer, which has no Hugging "
          "Face mapping; pass --skip-mtp to leave MTP layers out",
          key));
    }
    if (used.count(key) == 0 && !IsIgnoredSourceKey(key) && !IsNonModelStateKey(key) &&
        !(mtp && cfg.skip_mtp) && !(cfg.tie_word_embeddings && key == "output_layer.weight")) {
      return absl::InvalidArgumentError(
          fmt::format("checkpoint tensor '{}' [{}] has no Hugging Face mapping for --model {}", key,
                      fmt::join(t.shape, ","), cfg.family));
    }
  }
  // Safetensors layout: u64 header length, JSON header padded with spaces to 8 bytes, data.
  for (size_t s = 0; s < shards.size(); ++s) {
    PlannedShard ps;
    ps.file = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    nlohmann::json h = nlohmann::json::object();
    h["__metadata__"] = {{"format", "pt"}, {"bragg_run_id", std::string(kRunIdPlaceholder)}};
    uint64_t rel = 0;
    for (PlannedTensor& t : shards[s]) {
      h[t.map.hf_name] = {{"dtype", std::string(SafetensorsDType(t.dtype))},
                          {"shape", t.map.hf_shape},
                          {"data_offsets", {rel, rel + t.bytes}}};
      t.offset = rel;
      rel += t.bytes;
    }
    std::string json = h.dump();
    json.append((8 - json.size() % 8) % 8, ' ');
    uint64_t n = json.size();
    ps.header.resize(8);
    for (int k = 0; k < 8; ++k) {
      ps.header[k] = static_cast<char>((n >> (8 * k)) & 0xFF);
    }
    ps.header += json;
    for (PlannedTensor& t : shards[s]) {
      t.offset += ps.header.size();
    }
    ps.size = ps.header.size() + rel;
    ps.tensors = std::move(shards[s]);
    plan.shards.push_back(std::move(ps));
  }
  // Runs, grouped by (shard, source tensor, chunk).
  std::map<std::tuple<size_t, std::string, size_t>, WorkItem> items;
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    for (const PlannedTensor& t : plan.shards[s].tensors) {
      const SourceTensor& src = index.tensors.at(t.map.src_key);
      std::vector<RowSegment> segs = t.map.segments;
      if (segs.empty()) {
        segs.push_back({0, src.shape[t.map.FixedAxes()]});
      }
      for (size_t c = 0; c < src.chunks.size(); ++c) {
        WorkItem& w = items[{s, src.key, c}];
        w.shard = s;
        w.tensor = &src;
        w.chunk = c;
        int64_t base = 0;
        for (const RowSegment& seg : segs) {
          AddRuns(src, src.chunks[c], t.map, seg, base, t.offset, &w.runs);
          base += seg.count;
        }
      }
    }
  }
  for (auto& [key, w] : items) {
    if (w.runs.empty()) {
      continue;
    }
    std::sort(w.runs.begin(), w.runs.end(),
              [](const CopyRun& a, const CopyRun& b) { return a.src < b.src; });
    std::vector<CopyRun> merged;
    for (const CopyRun& r : w.runs) {
      if (!merged.empty() && merged.back().src + merged.back().bytes == r.src &&
          merged.back().dst + merged.back().bytes == r.dst) {
        merged.back().bytes += r.bytes;
      } else {
        merged.push_back(r);
      }
      w.bytes += r.bytes;
    }
    w.runs = std::move(merged);
    plan.items.push_back(std::move(w));
  }
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.bytes > b.bytes; });
  return plan;
}

std::vector<size_t> ShardsForRank(const Plan& plan, int rank, int world_size) {
  std::vector<size_t> order(plan.shards.size());
  for (size_t k = 0; k < order.size(); ++k) {
    order[k] = k;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return plan.shards[a].size > plan.shards[b].size; });
  std::vector<size_t> out;
  for (size_t k = 0; k < order.size(); ++k) {
    if (static_cast<int>(k % static_cast<size_t>(world_size)) == rank) {
      out.push_back(order[k]);
    }
  }
  return out;
}

std::string DescribePlan(const Plan& plan) {
  std::string out = fmt::format("{} shards, {} bytes, {} work items\n", plan.shards.size(),
                                plan.total_bytes, plan.items.size());
  for (const PlannedShard& s : plan.shards) {
    out += fmt::format("{} ({} bytes)\n", s.file, s.size);
    for (const PlannedTensor& t : s.tensors) {
      std::string segs;
      for (const RowSegment& r : t.map.segments) {
        segs += fmt::format(" [{},{})", r.start, r.start + r.count);
      }
      out += fmt::format("  {} {} [{}] @{} <- {}{}{}{}\n", t.map.hf_name, SafetensorsDType(t.dtype),
                         fmt::join(t.map.hf_shape, ","), t.offset, t.map.src_key,
                         t.map.layer >= 0 ? fmt::format("[{}]", t.map.layer) : "",
                         t.map.expert >= 0 ? fmt::format("[{}]", t.map.expert) : "",
                         segs.empty() ? "" : " rows" + segs);
    }
  }
  return out;
}

}  // namespace bragg::reshard
