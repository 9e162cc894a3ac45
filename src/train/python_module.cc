// pybind11 glue for bragg_train._core: the trainer's door (trainer.h) for Python. Trajectories
// come in as dicts of the JSONL format's fields (docs/train.md) holding lists or numpy arrays;
// log-probs go out as numpy arrays. Every call into the trainer runs with the GIL released, and
// one lock per trainer serialises the callers (a Trainer is driven by one thread at a time).
// Status errors become Python exceptions: InvalidArgument -> ValueError, NotFound ->
// FileNotFoundError, PermissionDenied -> PermissionError, anything else -> RuntimeError.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/blas_core.h"
#include "common/str_cat.h"
#include "train/run.h"
#include "train/trainer.h"
#include "train/trajectory.h"

namespace py = pybind11;

namespace bragg::train {
namespace {

[[noreturn]] void Raise(const Status& s) {
  std::string what(s.message());
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      throw py::value_error(what);
    case absl::StatusCode::kNotFound:
      PyErr_SetString(PyExc_FileNotFoundError, what.c_str());
      throw py::error_already_set();
    case absl::StatusCode::kPermissionDenied:
      PyErr_SetString(PyExc_PermissionError, what.c_str());
      throw py::error_already_set();
    default:
      throw std::runtime_error(what);
  }
}

void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

template <typename T>
T ValueOrRaise(Result<T> r) {
  if (!r.ok()) Raise(r.status());
  return std::move(r).value();
}

// One field of a trajectory: a 1-D sequence (a list, a numpy array; routed_experts may have any
// shape and is flattened) of numbers of the kind the field holds. Integer fields take integer
// arrays only (no silent truncation of 1.5), checked against the target type's range.
template <typename T>
std::vector<T> ReadField(py::handle value, const std::string& at, const char* field,
                         bool any_shape = false) {
  py::array a;
  try {
    a = py::array::ensure(value);
  } catch (const py::error_already_set&) {
  }
  if (!a) {
    throw py::value_error(Cat(at, ": \"", field, "\" is not a sequence of numbers"));
  }
  if (a.ndim() != 1 && !(any_shape && a.ndim() >= 1)) {
    throw py::value_error(Cat(at, ": \"", field, "\" must be 1-D, not ", a.ndim(), "-D"));
  }
  const char kind = a.dtype().kind();
  std::vector<T> out;
  out.reserve(static_cast<size_t>(a.size()));
  if (a.size() == 0) return out;
  if constexpr (std::is_integral_v<T>) {
    if (kind != 'i' && kind != 'u' && kind != 'b') {
      throw py::value_error(Cat(at, ": \"", field, "\" holds non-integers"));
    }
    auto ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
    if (kind == 'u' && ints) {
      // uint64 above INT64_MAX wraps in forcecast: check the source instead.
      auto big = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(a);
      for (py::ssize_t i = 0; i < big.size(); ++i) {
        if (big.data()[i] > static_cast<uint64_t>(std::numeric_limits<T>::max())) {
          throw py::value_error(
              Cat(at, ": \"", field, "\" holds ", big.data()[i], ", out of range"));
        }
      }
    }
    for (py::ssize_t i = 0; i < ints.size(); ++i) {
      int64_t v = ints.data()[i];
      if (v < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
          v > static_cast<int64_t>(std::numeric_limits<T>::max())) {
        throw py::value_error(Cat(at, ": \"", field, "\" holds ", v, ", out of range"));
      }
      out.push_back(static_cast<T>(v));
    }
  } else {
    if (kind != 'f' && kind != 'i' && kind != 'u') {
      throw py::value_error(Cat(at, ": \"", field, "\" holds non-numbers"));
    }
    auto fs = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
    out.assign(fs.data(), fs.data() + fs.size());
  }
  return out;
}

double ReadNumber(py::handle value, const std::string& at, const char* field) {
  if (PyBool_Check(value.ptr()) || !(PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr()) ||
                                     py::hasattr(value, "__float__"))) {
    throw py::value_error(Cat(at, ": \"", field, "\" is not a number"));
  }
  return value.cast<double>();
}

// A dict of the JSONL format's fields (ParseTrajectory's names and rules) to a Trajectory.
Trajectory ToTrajectory(py::handle obj, size_t index) {
  if (!py::isinstance<py::dict>(obj)) {
    throw py::type_error(Cat("trajectory ", index, " is a ",
                             std::string(py::str(obj.get_type().attr("__name__"))),
                             ", not a dict"));
  }
  py::dict d = py::reinterpret_borrow<py::dict>(obj);
  Trajectory t;
  t.id = d.contains("id") ? std::string(py::str(d["id"])) : Cat("#", index);
  const std::string at = Cat("trajectory ", t.id);
  for (auto [key, value] : d) {
    std::string k = py::str(key);
    if (k == "id") {
    } else if (k == "group") {
      t.group = py::str(value);
    } else if (k == "tokens") {
      t.tokens = ReadField<int32_t>(value, at, "tokens");
    } else if (k == "loss_mask") {
      for (int64_t m : ReadField<int64_t>(value, at, "loss_mask")) {
        if (m != 0 && m != 1) throw py::value_error(Cat(at, ": loss_mask holds ", m));
        t.loss_mask.push_back(static_cast<uint8_t>(m));
      }
    } else if (k == "logprobs") {
      t.logprobs = ReadField<float>(value, at, "logprobs");
    } else if (k == "versions") {
      t.versions = ReadField<int64_t>(value, at, "versions");
    } else if (k == "reward") {
      t.reward = ReadNumber(value, at, "reward");
    } else if (k == "advantage") {
      if (!value.is_none()) t.advantage = ReadNumber(value, at, "advantage");
    } else if (k == "routed_experts") {
      t.routed_experts = ReadField<int32_t>(value, at, "routed_experts", /*any_shape=*/true);
    } else {
      throw py::value_error(Cat(at, ": unknown field \"", k, "\""));
    }
  }
  for (const char* required : {"tokens", "loss_mask", "logprobs"}) {
    if (!d.contains(required)) throw py::value_error(Cat(at, ": no \"", required, "\""));
  }
  if (!d.contains("reward") && !t.advantage) {
    throw py::value_error(Cat(at, ": neither \"reward\" nor \"advantage\" is given"));
  }
  return t;
}

std::vector<Trajectory> ToBatch(py::handle batch) {
  if (py::isinstance<py::dict>(batch) || py::isinstance<py::str>(batch)) {
    throw py::type_error("a batch is a sequence of trajectory dicts, not a single one");
  }
  std::vector<Trajectory> out;
  size_t i = 0;
  for (py::handle t : batch) out.push_back(ToTrajectory(t, i++));
  return out;
}

template <typename T>
py::array_t<T> ToNumpy(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

py::dict MetricsDict(const StepMetrics& m) {
  // The same keys as a line of `bragg-train --metrics` (MetricsToJson), so that the two agree.
  py::module_ json = py::module_::import("json");
  return json.attr("loads")(MetricsToJson(m));
}

// A Trainer behind a lock: Python threads may share one; each call waits its turn with the GIL
// released, so other Python threads run while a step computes.
class PyTrainer {
 public:
  explicit PyTrainer(std::unique_ptr<Trainer> t) : trainer_(std::move(t)) {}

  static std::shared_ptr<PyTrainer> Create(const TrainOptions& options) {
    Result<std::unique_ptr<Trainer>> t;
    {
      py::gil_scoped_release release;
      t = Trainer::Create(options);
    }
    return std::make_shared<PyTrainer>(ValueOrRaise(std::move(t)));
  }

  static std::shared_ptr<PyTrainer> Resume(const std::string& dir, const TrainOptions& options) {
    Result<std::unique_ptr<Trainer>> t;
    {
      py::gil_scoped_release release;
      t = Trainer::Resume(dir, options);
    }
    return std::make_shared<PyTrainer>(ValueOrRaise(std::move(t)));
  }

  // Runs fn(trainer) with the GIL released and this trainer's lock held.
  template <typename Fn>
  auto Locked(Fn fn) {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    return fn(*trainer_);
  }

  py::dict Step(py::handle batch) {
    std::vector<Trajectory> b = ToBatch(batch);
    Result<StepMetrics> m = Locked([&](Trainer& t) { return t.Step(b); });
    return MetricsDict(ValueOrRaise(std::move(m)));
  }

  py::list LogProbs(py::handle batch) {
    std::vector<Trajectory> b = ToBatch(batch);
    auto r = Locked([&](Trainer& t) { return t.LogProbs(b); });
    py::list out;
    for (const std::vector<float>& v : ValueOrRaise(std::move(r))) out.append(ToNumpy(v));
    return out;
  }

  py::list RoutedExperts(py::handle batch) {
    std::vector<Trajectory> b = ToBatch(batch);
    auto r = Locked([&](Trainer& t) { return t.RoutedExperts(b); });
    py::list out;
    for (const std::vector<int32_t>& v : ValueOrRaise(std::move(r))) out.append(ToNumpy(v));
    return out;
  }

  void SaveModel(const std::string& dir) {
    Check(Locked([&](Trainer& t) { return t.SaveModel(dir); }));
  }
  void SaveCheckpoint(const std::string& root) {
    Check(Locked([&](Trainer& t) { return t.SaveCheckpoint(root); }));
  }
  void SaveGradients(py::handle batch, const std::string& path) {
    std::vector<Trajectory> b = ToBatch(batch);
    Check(Locked([&](Trainer& t) { return t.SaveGradients(b, path); }));
  }

  int64_t step() {
    return Locked([](Trainer& t) { return t.step(); });
  }
  int64_t version() {
    return Locked([](Trainer& t) { return t.version(); });
  }
  void set_version(int64_t v) {
    if (v < 0) throw py::value_error("a weight version is >= 0");
    Locked([&](Trainer& t) { t.set_version(v); });
  }
  void set_lr(double lr) {
    if (!(lr >= 0) || !std::isfinite(lr)) throw py::value_error("lr must be finite and >= 0");
    Locked([&](Trainer& t) { t.set_lr(lr); });
  }
  TrainOptions options() {
    return Locked([](Trainer& t) { return t.options(); });
  }

 private:
  std::mutex mu_;
  std::unique_ptr<Trainer> trainer_;
};

// A TrainOptions field holding an option enum, as its name (trainer.h's Parse* and Name).
template <typename E>
void EnumOption(py::class_<TrainOptions>& c, const char* name, E TrainOptions::*field,
                Result<E> (*parse)(std::string_view)) {
  c.def_property(
      name, [field](const TrainOptions& o) { return std::string(Name(o.*field)); },
      [field, parse](TrainOptions& o, const std::string& s) { o.*field = ValueOrRaise(parse(s)); });
}

}  // namespace
}  // namespace bragg::train

PYBIND11_MODULE(_core, m) {
  // bragg_train/__init__.py asks, in a process of its own, before any process that computes
  // loads this module (common/blas_core.h).
  m.def("known_blas_core", &bragg::KnownBlasCore,
        "the OPENBLAS_CORETYPE a process should start with on this CPU, or \"\"");
  m.def("blas_fallback_core", &bragg::BlasFallbackCore,
        "the core the loaded OpenBLAS should run where it fell back to Prescott, whatever "
        "OPENBLAS_CORETYPE says, or \"\"");
  using namespace bragg::train;
  m.doc() = "bragg-train's trainer (src/train/trainer.h); use the bragg_train package";

  // Every field of TrainOptions by its C++ name (docs/train.md); assigning an unknown name is an
  // AttributeError, so a misspelt option cannot be silently ignored.
  py::class_<TrainOptions> opts(m, "TrainOptions");
  opts.def(py::init<>())
      .def_readwrite("model_dir", &TrainOptions::model_dir)
      .def_readwrite("reference_dir", &TrainOptions::reference_dir)
      .def_readwrite("bf16", &TrainOptions::bf16)
      .def_readwrite("threads", &TrainOptions::threads)
      .def_readwrite("deterministic", &TrainOptions::deterministic)
      .def_readwrite("temperature", &TrainOptions::temperature)
      .def_readwrite("lr", &TrainOptions::lr)
      .def_readwrite("beta1", &TrainOptions::beta1)
      .def_readwrite("beta2", &TrainOptions::beta2)
      .def_readwrite("eps", &TrainOptions::eps)
      .def_readwrite("weight_decay", &TrainOptions::weight_decay)
      .def_readwrite("max_grad_norm", &TrainOptions::max_grad_norm)
      .def_readwrite("optimizer_chunk_elements", &TrainOptions::optimizer_chunk_elements)
      .def_readwrite("normalize_std", &TrainOptions::normalize_std)
      .def_readwrite("clip_low", &TrainOptions::clip_low)
      .def_readwrite("clip_high", &TrainOptions::clip_high)
      .def_readwrite("tis_cap", &TrainOptions::tis_cap)
      .def_readwrite("kl_coef", &TrainOptions::kl_coef)
      .def_readwrite("entropy_coef", &TrainOptions::entropy_coef)
      .def_readwrite("minibatches", &TrainOptions::minibatches)
      .def_readwrite("max_tokens", &TrainOptions::max_tokens)
      .def_readwrite("lce_token_chunk", &TrainOptions::lce_token_chunk)
      .def_readwrite("fused_cross_entropy", &TrainOptions::fused_cross_entropy)
      .def_readwrite("padded", &TrainOptions::padded)
      .def_readwrite("world_size", &TrainOptions::world_size)
      .def_readwrite("rank", &TrainOptions::rank)
      .def_readwrite("rendezvous", &TrainOptions::rendezvous);
  EnumOption(opts, "objective", &TrainOptions::objective, &ParseObjective);
  EnumOption(opts, "recompute", &TrainOptions::recompute, &ParseRecompute);
  EnumOption(opts, "dp_balance", &TrainOptions::dp_balance, &ParseDpBalance);

  py::class_<PyTrainer, std::shared_ptr<PyTrainer>>(m, "Trainer")
      .def_static("create", &PyTrainer::Create, py::arg("options"))
      .def_static("resume", &PyTrainer::Resume, py::arg("checkpoint_dir"), py::arg("options"))
      .def("step", &PyTrainer::Step, py::arg("batch"))
      .def("logprobs", &PyTrainer::LogProbs, py::arg("batch"))
      .def("routed_experts", &PyTrainer::RoutedExperts, py::arg("batch"))
      .def("save_model", &PyTrainer::SaveModel, py::arg("dir"))
      .def("save_checkpoint", &PyTrainer::SaveCheckpoint, py::arg("root"))
      .def("save_gradients", &PyTrainer::SaveGradients, py::arg("batch"), py::arg("path"))
      .def_property_readonly("steps", &PyTrainer::step)
      .def_property("version", &PyTrainer::version, &PyTrainer::set_version)
      .def("set_lr", &PyTrainer::set_lr, py::arg("lr"))
      .def_property_readonly("options", &PyTrainer::options);

  m.def(
      "read_trajectories",
      [](const std::string& path) {
        bragg::Result<std::vector<Trajectory>> r;
        {
          py::gil_scoped_release release;
          r = ReadTrajectories(path);
        }
        std::vector<Trajectory> ts = ValueOrRaise(std::move(r));
        py::list out;
        for (const Trajectory& t : ts) {
          py::dict d;
          d["id"] = t.id;
          d["group"] = t.group;
          d["tokens"] = ToNumpy(t.tokens);
          d["loss_mask"] = ToNumpy(t.loss_mask);
          d["logprobs"] = ToNumpy(t.logprobs);
          if (!t.versions.empty()) d["versions"] = ToNumpy(t.versions);
          d["reward"] = t.reward;
          if (t.advantage) d["advantage"] = *t.advantage;
          if (!t.routed_experts.empty()) d["routed_experts"] = ToNumpy(t.routed_experts);
          out.append(std::move(d));
        }
        return out;
      },
      py::arg("path"));

  m.def(
      "group_advantages",
      [](py::handle batch, bool normalize_std) {
        std::vector<Trajectory> b = ToBatch(batch);
        return ToNumpy(GroupAdvantages(b, normalize_std));
      },
      py::arg("batch"), py::arg("normalize_std") = true);
}
