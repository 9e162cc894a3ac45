#include "train/optim/offload_adamw.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <set>

#include "absl/strings/str_cat.h"
#include "train/optim/copy_worker.h"

namespace bragg::train {
namespace {

constexpr int kMaster = 0;
constexpr int kExpAvg = 1;
constexpr int kExpAvgSq = 2;
constexpr int kGrad = 3;
constexpr int kArrays = 4;

std::string ShapeString(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    absl::StrAppend(&out, i ? ", " : "", shape[i]);
  }
  return out + "]";
}

bool SupportedDtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// A tensor on `device`: "cuda" (no index) accepts any CUDA device, as torch's "cuda" means the
// current one.
bool OnDevice(const torch::Tensor& t, const torch::Device& device) {
  return t.device().type() == device.type() &&
         (!device.has_index() || t.device().index() == device.index());
}

Status CheckOptions(const AdamWOptions& o) {
  auto bad = [](std::string what) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW options: ", what));
  };
  if (!(o.lr >= 0)) {
    return bad(absl::StrCat("lr must be >= 0, got ", o.lr));
  }
  if (!(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1)) {
    return bad(absl::StrCat("betas must be in [0, 1), got ", o.beta1, ", ", o.beta2));
  }
  if (!(o.eps >= 0) || !(o.weight_decay >= 0)) {
    return bad(
        absl::StrCat("eps and weight_decay must be >= 0, got ", o.eps, ", ", o.weight_decay));
  }
  if (o.chunk_elements <= 0) {
    return bad(absl::StrCat("chunk_elements must be > 0, got ", o.chunk_elements));
  }
  if (!(o.max_grad_norm >= 0) || std::isinf(o.max_grad_norm)) {
    return bad(absl::StrCat("max_grad_norm must be finite and >= 0 (0: no clipping), got ",
                            o.max_grad_norm));
  }
  if (!o.device.is_cpu() && !o.device.is_cuda()) {
    return bad(absl::StrCat("device must be cpu or cuda, got ", o.device.str()));
  }
  if (o.device.is_cuda() && !torch::cuda::is_available()) {
    return absl::FailedPreconditionError(
        absl::StrCat("AdamW device ", o.device.str(),
                     ": this libtorch has no CUDA (or no GPU is visible); use the cpu device"));
  }
  return absl::OkStatus();
}

}  // namespace

Result<std::unique_ptr<OffloadAdamW>> OffloadAdamW::Create(
    std::vector<std::pair<std::string, torch::Tensor>> named_params, const AdamWOptions& options) {
  BRAGG_RETURN_IF_ERROR(CheckOptions(options));
  if (named_params.empty()) {
    return absl::InvalidArgumentError("OffloadAdamW: no parameters to optimize");
  }
  std::set<std::string> names;
  std::set<const void*> storages;
  std::vector<Param> params;
  int64_t total = 0;
  for (auto& [name, t] : named_params) {
    auto bad = [&name](std::string what) {
      return absl::InvalidArgumentError(
          absl::StrCat("OffloadAdamW: parameter '", name, "' ", what));
    };
    if (name.empty()) {
      return absl::InvalidArgumentError("OffloadAdamW: a parameter has an empty name");
    }
    if (!names.insert(name).second) {
      return bad("is named twice: parameter names must be unique (they name the state)");
    }
    if (!t.defined()) {
      return bad("is an undefined tensor");
    }
    if (!OnDevice(t, options.device)) {
      return bad(absl::StrCat("is on ", t.device().str(), ", the optimizer's device is ",
                              options.device.str()));
    }
    if (!SupportedDtype(t.scalar_type())) {
      return bad(absl::StrCat("has dtype ", c10::toString(t.scalar_type()),
                              ": only float32 and bfloat16 are supported"));
    }
    if (!t.is_contiguous()) {
      return bad("is not contiguous");
    }
    if (!t.requires_grad()) {
      return bad("does not require grad");
    }
    if (t.numel() > 0 && !storages.insert(t.data_ptr()).second) {
      return bad("shares its memory with another parameter: pass each tensor once");
    }
    Param p;
    p.name = name;
    p.tensor = t;
    p.flat = t.detach().view({-1});
    p.shape = t.sizes().vec();
    p.offset = total;
    p.numel = t.numel();
    total += p.numel;
    params.push_back(std::move(p));
  }
  std::unique_ptr<OffloadAdamW> opt(new OffloadAdamW(std::move(params), options, total));
  try {
    auto host = torch::TensorOptions().dtype(torch::kFloat).pinned_memory(options.device.is_cuda());
    opt->master_ = torch::empty({total}, host);
    opt->exp_avg_ = torch::zeros({total}, host);
    opt->exp_avg_sq_ = torch::zeros({total}, host);
    for (const Param& p : opt->params_) {
      opt->master_.narrow(0, p.offset, p.numel).copy_(p.flat);
    }
    for (auto& w : opt->workspace_) {
      w = torch::empty({kArrays, opt->chunk_},
                       torch::TensorOptions().dtype(torch::kFloat).device(options.device));
    }
  } catch (const std::exception& e) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "OffloadAdamW: allocating the state (", opt->state_bytes(), " host bytes) and workspace (",
        opt->workspace_bytes(), " device bytes) failed: ", e.what()));
  }
  return opt;
}

OffloadAdamW::OffloadAdamW(std::vector<Param> params, const AdamWOptions& options, int64_t total)
    : params_(std::move(params)),
      options_(options),
      total_(total),
      chunk_(std::max<int64_t>(1, std::min(options.chunk_elements, total))),
      worker_(std::make_unique<CopyWorker>()) {}

OffloadAdamW::~OffloadAdamW() = default;

int64_t OffloadAdamW::workspace_bytes() const {
  return 2 * kArrays * chunk_ * static_cast<int64_t>(sizeof(float));
}

int64_t OffloadAdamW::state_bytes() const {
  return 3 * total_ * static_cast<int64_t>(sizeof(float));
}

std::vector<OffloadAdamW::Segment> OffloadAdamW::ChunkSegments(int64_t c) const {
  const int64_t begin = c * chunk_;
  const int64_t end = std::min(total_, begin + chunk_);
  std::vector<Segment> out;
  // The first parameter whose range reaches past `begin`.
  auto it = std::upper_bound(params_.begin(), params_.end(), begin,
                             [](int64_t x, const Param& p) { return x < p.offset + p.numel; });
  for (; it != params_.end() && it->offset < end; ++it) {
    if (it->numel == 0) {
      continue;
    }
    const int64_t lo = std::max(begin, it->offset);
    const int64_t hi = std::min(end, it->offset + it->numel);
    out.push_back(
        Segment{static_cast<int>(it - params_.begin()), lo - it->offset, lo - begin, hi - lo});
  }
  return out;
}

int64_t OffloadAdamW::Load(const StepPlan& plan, int64_t c, int b) {
  const int64_t begin = c * chunk_;
  const int64_t n = std::min(total_, begin + chunk_) - begin;
  torch::Tensor& ws = workspace_[b];
  ws[kMaster].narrow(0, 0, n).copy_(master_.narrow(0, begin, n));
  ws[kExpAvg].narrow(0, 0, n).copy_(exp_avg_.narrow(0, begin, n));
  ws[kExpAvgSq].narrow(0, 0, n).copy_(exp_avg_sq_.narrow(0, begin, n));
  int64_t bytes = 3 * n * static_cast<int64_t>(sizeof(float));
  for (const Segment& s : ChunkSegments(c)) {
    const torch::Tensor& g = plan.grads[s.param];
    if (!g.defined()) {
      continue;
    }
    ws[kGrad].narrow(0, s.chunk_offset, s.length).copy_(g.narrow(0, s.param_offset, s.length));
    bytes += s.length * static_cast<int64_t>(g.element_size());
  }
  return bytes;
}

int64_t OffloadAdamW::Store(const StepPlan& plan, int64_t c, int b) {
  const int64_t begin = c * chunk_;
  const int64_t n = std::min(total_, begin + chunk_) - begin;
  torch::Tensor& ws = workspace_[b];
  master_.narrow(0, begin, n).copy_(ws[kMaster].narrow(0, 0, n));
  exp_avg_.narrow(0, begin, n).copy_(ws[kExpAvg].narrow(0, 0, n));
  exp_avg_sq_.narrow(0, begin, n).copy_(ws[kExpAvgSq].narrow(0, 0, n));
  int64_t bytes = 3 * n * static_cast<int64_t>(sizeof(float));
  for (const Segment& s : ChunkSegments(c)) {
    if (!plan.grads[s.param].defined()) {
      continue;
    }
    const torch::Tensor& flat = params_[s.param].flat;
    flat.narrow(0, s.param_offset, s.length).copy_(ws[kMaster].narrow(0, s.chunk_offset, s.length));
    bytes += s.length * static_cast<int64_t>(flat.element_size());
  }
  return bytes;
}

void OffloadAdamW::Update(const StepPlan& plan, int64_t c, int b) {
  const AdamWOptions& o = options_;
  torch::Tensor& ws = workspace_[b];
  for (const Segment& s : ChunkSegments(c)) {
    if (!plan.grads[s.param].defined()) {
      continue;
    }
    torch::Tensor param = ws[kMaster].narrow(0, s.chunk_offset, s.length);
    torch::Tensor exp_avg = ws[kExpAvg].narrow(0, s.chunk_offset, s.length);
    torch::Tensor exp_avg_sq = ws[kExpAvgSq].narrow(0, s.chunk_offset, s.length);
    torch::Tensor grad = ws[kGrad].narrow(0, s.chunk_offset, s.length);
    if (plan.clip) {
      // torch's clip_grad_norm_: grad.mul_(clip_coef_clamped), an FP32 0-dim tensor.
      grad.mul_(plan.clip_coef);
    }
    // torch/optim/adam.py `_single_tensor_adam` (torch 2.9.1), decoupled weight decay,
    // capturable=False: the same ops with the same Python-float scalars. params_[].step was
    // already advanced for this step (step_t += 1 comes first there).
    const double step = static_cast<double>(params_[s.param].step);
    if (o.weight_decay != 0) {
      param.mul_(1 - o.lr * o.weight_decay);
    }
    exp_avg.lerp_(grad, 1 - o.beta1);
    exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, 1 - o.beta2);
    const double bias_correction1 = 1 - std::pow(o.beta1, step);
    const double bias_correction2 = 1 - std::pow(o.beta2, step);
    const double step_size = o.lr / bias_correction1;
    // Python's `bias_correction2**0.5` is C pow(x, 0.5), not sqrt(x): keep the call.
    const double bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
    // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps), in the grad's buffer: the
    // grad is not needed any more, and a new tensor would grow the workspace.
    torch::Tensor denom = torch::sqrt_out(grad, exp_avg_sq);
    denom.div_(bias_correction2_sqrt).add_(o.eps);
    param.addcdiv_(exp_avg, denom, -step_size);
  }
}

Result<StepStats> OffloadAdamW::Step() {
  const auto start = std::chrono::steady_clock::now();
  StepStats stats;
  StepPlan plan;
  plan.grads.resize(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    const torch::Tensor& g = p.tensor.grad();
    if (!g.defined()) {
      continue;
    }
    if (g.numel() != p.numel || !OnDevice(g, options_.device) || !SupportedDtype(g.scalar_type())) {
      return absl::InvalidArgumentError(
          absl::StrCat("OffloadAdamW step: the grad of '", p.name, "' is ", ShapeString(g.sizes()),
                       " ", c10::toString(g.scalar_type()), " on ", g.device().str(), "; expected ",
                       ShapeString(p.shape), " float32 or bfloat16 on ", options_.device.str()));
    }
    // A view for a contiguous grad; a copy (on the device) for a strided one.
    plan.grads[i] = g.detach().reshape({-1});
  }
  int64_t norm_bytes = 0;
  try {
    if (options_.max_grad_norm > 0) {
      // torch.nn.utils.clip_grad_norm_: the norm of the per-parameter norms, then
      // max_norm / (total + 1e-6) clamped to 1, as FP32 tensors on the grads' device.
      std::vector<torch::Tensor> norms;
      for (const torch::Tensor& g : plan.grads) {
        if (g.defined()) {
          norms.push_back(g.norm(2).to(torch::kFloat));
        }
      }
      if (!norms.empty()) {
        torch::Tensor total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(2);
        norm_bytes = static_cast<int64_t>(2 * norms.size() + 1) * 4;
        stats.grad_norm = total.item<double>();
        if (!std::isfinite(stats.grad_norm)) {
          return absl::FailedPreconditionError(absl::StrCat(
              "OffloadAdamW step ", step_ + 1, ": the global grad norm is ", stats.grad_norm,
              " (a NaN or inf grad); the optimizer state is unchanged: skip this batch or "
              "lower the learning rate / loss scale"));
        }
        torch::Tensor coef =
            torch::clamp(options_.max_grad_norm / (total + 1e-6), c10::nullopt, 1.0);
        plan.clip_coef = coef.item<float>();
        plan.clip = true;
      }
    }
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("OffloadAdamW step: grad norm: ", e.what()));
  }

  for (size_t i = 0; i < params_.size(); ++i) {
    if (plan.grads[i].defined()) {
      ++params_[i].step;
    }
  }
  const int64_t chunks = total_ == 0 ? 0 : (total_ + chunk_ - 1) / chunk_;
  int64_t bytes = 0;
  try {
    // Double buffer: chunk c is updated in buffer c % 2 while the copy worker stores chunk c - 1
    // from, and then loads chunk c + 1 into, the other buffer.
    if (chunks > 0) {
      bytes += Load(plan, 0, 0);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const int b = static_cast<int>(c % 2);
      int64_t side_bytes = 0;
      const bool side = c > 0 || c + 1 < chunks;
      if (side) {
        worker_->Start([this, &plan, &side_bytes, c, b, chunks] {
          if (c > 0) {
            side_bytes += Store(plan, c - 1, 1 - b);
          }
          if (c + 1 < chunks) {
            side_bytes += Load(plan, c + 1, 1 - b);
          }
        });
      }
      std::exception_ptr update_error;
      try {
        Update(plan, c, b);
      } catch (...) {
        update_error = std::current_exception();
      }
      worker_->Wait();  // before rethrowing: the job refers to this frame
      if (update_error) {
        std::rethrow_exception(update_error);
      }
      bytes += side_bytes;
    }
    if (chunks > 0) {
      bytes += Store(plan, chunks - 1, static_cast<int>((chunks - 1) % 2));
    }
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("OffloadAdamW step ", step_ + 1,
                     ": the update failed mid-stream (the "
                     "optimizer state is now undefined: reload a checkpoint): ",
                     e.what()));
  }
  ++step_;
  stats.bytes_streamed = bytes;
  stats.chunks = chunks;
  stats.peak_workspace_bytes = workspace_bytes() + norm_bytes;
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

std::vector<std::pair<std::string, torch::Tensor>> OffloadAdamW::StateTensors() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  out.reserve(4 * params_.size());
  for (const Param& p : params_) {
    out.emplace_back(p.name + ".master", master_.narrow(0, p.offset, p.numel).view(p.shape));
    out.emplace_back(p.name + ".exp_avg", exp_avg_.narrow(0, p.offset, p.numel).view(p.shape));
    out.emplace_back(p.name + ".exp_avg_sq",
                     exp_avg_sq_.narrow(0, p.offset, p.numel).view(p.shape));
    out.emplace_back(p.name + ".step", torch::tensor(static_cast<float>(p.step)));
  }
  return out;
}

Status OffloadAdamW::LoadState(const std::map<std::string, torch::Tensor>& state, int64_t step) {
  if (step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("OffloadAdamW load: step ", step, " < 0"));
  }
  std::set<std::string> known;
  std::vector<int64_t> steps(params_.size(), step);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    for (const char* suffix : {".master", ".exp_avg", ".exp_avg_sq"}) {
      const std::string name = p.name + suffix;
      known.insert(name);
      auto it = state.find(name);
      if (it == state.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("OffloadAdamW load: state tensor '", name, "' is missing"));
      }
      const torch::Tensor& t = it->second;
      if (!t.defined() || t.scalar_type() != torch::kFloat ||
          t.sizes() != at::IntArrayRef(p.shape)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "OffloadAdamW load: state tensor '", name, "' is ",
            t.defined() ? absl::StrCat(ShapeString(t.sizes()), " ", c10::toString(t.scalar_type()))
                        : "undefined",
            "; expected ", ShapeString(p.shape), " Float (the parameter's shape)"));
      }
    }
    const std::string step_name = p.name + ".step";
    known.insert(step_name);
    if (auto it = state.find(step_name); it != state.end()) {
      const torch::Tensor& t = it->second;
      if (!t.defined() || t.numel() != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("OffloadAdamW load: state tensor '", step_name, "' must hold one number"));
      }
      const double v = t.item<double>();
      if (!(v >= 0) || v != std::floor(v)) {
        return absl::InvalidArgumentError(absl::StrCat("OffloadAdamW load: state tensor '",
                                                       step_name, "' is ", v,
                                                       ": a step count is a whole number >= 0"));
      }
      steps[i] = static_cast<int64_t>(v);
    }
  }
  for (const auto& [name, t] : state) {
    if (!known.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("OffloadAdamW load: state tensor '", name,
                                                     "' names no parameter of this optimizer"));
    }
  }
  try {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      Param& p = params_[i];
      auto dst = [&](const torch::Tensor& flat) { return flat.narrow(0, p.offset, p.numel); };
      dst(master_).copy_(state.at(p.name + ".master").reshape({-1}));
      dst(exp_avg_).copy_(state.at(p.name + ".exp_avg").reshape({-1}));
      dst(exp_avg_sq_).copy_(state.at(p.name + ".exp_avg_sq").reshape({-1}));
      p.flat.copy_(dst(master_));
      p.step = steps[i];
    }
  } catch (const std::exception& e) {
    return absl::InternalError(
        absl::StrCat("OffloadAdamW load: copying the state failed (the "
                     "optimizer state is now undefined): ",
                     e.what()));
  }
  step_ = step;
  return absl::OkStatus();
}

}  // namespace bragg::train
