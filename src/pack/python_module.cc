// pybind11 glue for bragg_pack._core: numpy in, numpy out; Status errors become ValueError.
// Planning runs with the GIL released.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "fmt/format.h"
#include "pack/cost_model.h"
#include "pack/plan.h"
#include "pack/zigzag.h"

namespace py = pybind11;

namespace bragg::pack {
namespace {

template <typename T>
T ValueOrThrow(Result<T> r) {
  if (!r.ok()) {
    throw py::value_error(std::string(r.status().message()));
  }
  return std::move(r).value();
}

template <typename T>
py::array_t<T> ToNumpy(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using F64Array = py::array_t<double, py::array::c_style | py::array::forcecast>;

std::shared_ptr<Plan> PlanPy(I64Array lengths, int dp, int64_t max_tokens, int micro_batches,
                             int cp, int tp, bool sp, bool fp8, double cost_a, double cost_b,
                             std::optional<I64Array> ids, std::optional<I64Array> loss_tokens,
                             std::optional<F64Array> costs, const std::string& method, bool refine,
                             const std::string& fp8_align) {
  if (lengths.ndim() != 1) {
    throw py::value_error("lengths must be a 1-D array");
  }
  const size_t n = static_cast<size_t>(lengths.size());
  auto check = [&](const auto& a, const char* name) {
    if (a && (a->ndim() != 1 || static_cast<size_t>(a->size()) != n)) {
      throw py::value_error(fmt::format("{} must be 1-D with one entry per trace", name));
    }
  };
  check(ids, "ids");
  check(loss_tokens, "loss_tokens");
  check(costs, "costs");
  std::vector<Trace> traces(n);
  for (size_t i = 0; i < n; ++i) {
    traces[i].id = ids ? ids->at(static_cast<py::ssize_t>(i)) : static_cast<int64_t>(i);
    traces[i].length = lengths.at(static_cast<py::ssize_t>(i));
    if (loss_tokens) {
      traces[i].loss_tokens = loss_tokens->at(static_cast<py::ssize_t>(i));
    }
    if (costs) {
      traces[i].cost = costs->at(static_cast<py::ssize_t>(i));
    }
  }
  if (!fp8 && fp8_align != "trace") {
    throw py::value_error("fp8_align='" + fp8_align + "' needs fp8=True");
  }
  PackConfig config{.dp = dp,
                    .max_tokens = max_tokens,
                    .micro_batches = micro_batches,
                    .cp = cp,
                    .tp = tp,
                    .sequence_parallel = sp,
                    .fp8 = fp8,
                    .fp8_align = ValueOrThrow(ParseFp8Align(fp8_align)),
                    .cost = {.a = cost_a, .b = cost_b},
                    .method = ValueOrThrow(ParseMethod(method)),
                    .refine = refine};
  Result<Plan> plan = absl::UnknownError("not run");
  {
    py::gil_scoped_release release;
    plan = PlanPacking(traces, config);
  }
  return std::make_shared<Plan>(ValueOrThrow(std::move(plan)));
}

py::dict SummaryDict(const Plan& p) {
  const PlanSummary& s = p.summary;
  py::dict d;
  d["method"] = std::string(MethodName(p.config.method));
  d["traces"] = s.traces;
  d["ranks"] = s.ranks;
  d["micro_batches_per_rank"] = s.micro_batches_per_rank;
  d["alignment"] = s.alignment;
  d["row_alignment"] = s.row_alignment;
  d["real_tokens"] = s.real_tokens;
  d["padded_tokens"] = s.padded_tokens;
  d["padding_fraction"] = s.padding_fraction;
  d["max_rank_cost"] = s.max_rank_cost;
  d["mean_rank_cost"] = s.mean_rank_cost;
  d["max_over_mean"] = s.max_over_mean;
  d["lower_bound"] = s.lower_bound;
  d["step_max_over_mean"] = s.step_max_over_mean;
  d["oversized_trace_ids"] = s.oversized_trace_ids;
  d["plan_ms"] = s.plan_ms;
  return d;
}

py::dict RowDict(const Row& row) {
  py::dict d;
  d["trace_ids"] = ToNumpy(row.trace_ids);
  d["cu_seqlens"] = ToNumpy(row.cu_seqlens);
  d["cu_seqlens_padded"] = ToNumpy(row.cu_seqlens_padded);
  d["max_seqlen"] = row.max_seqlen;
  d["total_tokens"] = row.total_tokens;
  d["real_tokens"] = row.real_tokens;
  d["loss_tokens"] = row.loss_tokens;
  d["cost"] = row.cost;
  d["position_ids"] = ToNumpy(PositionIds(row));
  return d;
}

const MicroBatch& GetMicroBatch(const Plan& p, int rank, int step) {
  if (rank < 0 || rank >= static_cast<int>(p.ranks.size()) || step < 0 ||
      step >= static_cast<int>(p.ranks[static_cast<size_t>(rank)].micro_batches.size())) {
    throw py::index_error(fmt::format("no micro-batch {} on rank {} (plan has {} ranks x {})", step,
                                      rank, p.ranks.size(), p.summary.micro_batches_per_rank));
  }
  return p.ranks[static_cast<size_t>(rank)].micro_batches[static_cast<size_t>(step)];
}

}  // namespace
}  // namespace bragg::pack

PYBIND11_MODULE(_core, m) {
  using namespace bragg::pack;
  m.doc() = "bragg::pack bindings: THD packing, balancing and zigzag CP partitioning";

  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def_property_readonly("summary", &SummaryDict)
      .def_property_readonly("num_ranks", [](const Plan& p) { return p.ranks.size(); })
      .def_property_readonly("micro_batches_per_rank",
                             [](const Plan& p) { return p.summary.micro_batches_per_rank; })
      .def(
          "rank_cost", [](const Plan& p, int r) { return p.ranks.at(static_cast<size_t>(r)).cost; },
          py::arg("rank"))
      .def(
          "micro_batch",
          [](const Plan& p, int rank, int step) {
            const MicroBatch& mb = GetMicroBatch(p, rank, step);
            if (mb.rows.size() == 1) {
              return RowDict(mb.rows[0]);
            }
            py::list rows;
            for (const Row& row : mb.rows) {
              rows.append(RowDict(row));
            }
            py::dict d;
            d["rows"] = rows;
            d["cost"] = mb.cost;
            d["total_tokens"] = mb.total_tokens;
            return d;
          },
          py::arg("rank"), py::arg("step"),
          "One micro-batch as a dict of numpy arrays (THD: the packed row itself).");

  m.def("plan", &PlanPy, py::arg("lengths"), py::arg("dp"), py::arg("max_tokens") = 0,
        py::arg("micro_batches") = 0, py::arg("cp") = 1, py::arg("tp") = 1, py::arg("sp") = false,
        py::arg("fp8") = false, py::arg("cost_a") = 1.0, py::arg("cost_b") = 0.0,
        py::arg("ids") = py::none(), py::arg("loss_tokens") = py::none(),
        py::arg("costs") = py::none(), py::arg("method") = "lpt", py::arg("refine") = true,
        py::arg("fp8_align") = "trace",
        "Plans THD packing; releases the GIL while planning. Raises ValueError on bad input. "
        "fp8_align: 'trace' pads every trace to lcm(16, A) with fp8; 'row' pads traces to A and "
        "each packed row so that every CP/SP rank holds a multiple of 16 tokens.");

  m.def(
      "cp_indices",
      [](I32Array cu, int cp, int rank) {
        std::vector<int32_t> v(cu.data(), cu.data() + cu.size());
        return ToNumpy(ValueOrThrow(CpIndices(v, cp, rank)));
      },
      py::arg("cu_seqlens_padded"), py::arg("cp"), py::arg("rank"),
      "Zigzag token indices of CP rank `rank` (TransformerEngine's thd_get_partitioned_indices).");

  auto align_config = [](int cp, int tp, bool sp, bool fp8, const std::string& fp8_align) {
    return PackConfig{.cp = cp,
                      .tp = tp,
                      .sequence_parallel = sp,
                      .fp8 = fp8,
                      .fp8_align = ValueOrThrow(ParseFp8Align(fp8_align)),
                      .cost = {}};
  };
  m.def(
      "alignment",
      [align_config](int cp, int tp, bool sp, bool fp8, const std::string& fp8_align) {
        return ValueOrThrow(Alignment(align_config(cp, tp, sp, fp8, fp8_align)));
      },
      py::arg("cp") = 1, py::arg("tp") = 1, py::arg("sp") = false, py::arg("fp8") = false,
      py::arg("fp8_align") = "trace", "Per-trace padding multiple A.");
  m.def(
      "row_alignment",
      [align_config](int cp, int tp, bool sp, bool fp8, const std::string& fp8_align) {
        return ValueOrThrow(RowAlignment(align_config(cp, tp, sp, fp8, fp8_align)));
      },
      py::arg("cp") = 1, py::arg("tp") = 1, py::arg("sp") = false, py::arg("fp8") = false,
      py::arg("fp8_align") = "trace", "Multiple of every packed row's total.");

  m.def(
      "cost_model_from_model_size",
      [](int64_t hidden, int64_t layers) {
        CostModel c = ValueOrThrow(CostModel::FromModelSize(hidden, layers));
        return py::make_tuple(c.a, c.b);
      },
      py::arg("hidden"), py::arg("layers"), "(a, b) of cost(s) = a*s + b*s^2 in training FLOPs.");

  m.def(
      "fit_cost_model",
      [](F64Array linear, F64Array quadratic, F64Array seconds) {
        if (linear.size() != quadratic.size() || linear.size() != seconds.size()) {
          throw py::value_error("linear, quadratic and seconds must have the same length");
        }
        std::vector<StepSample> s(static_cast<size_t>(linear.size()));
        for (size_t i = 0; i < s.size(); ++i) {
          s[i] = {linear.data()[i], quadratic.data()[i], seconds.data()[i]};
        }
        CostFit f = ValueOrThrow(FitCostModel(s));
        return py::make_tuple(f.model.a, f.model.b, f.r_squared);
      },
      py::arg("linear"), py::arg("quadratic"), py::arg("seconds"),
      "Least-squares fit of seconds = a*linear + b*quadratic; returns (a, b, r_squared).");
}
