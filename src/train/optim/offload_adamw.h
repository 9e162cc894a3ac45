#pragma once

// AdamW with its FP32 state (master weights, exp_avg, exp_avg_sq) in host memory, streamed
// chunk by chunk through a bounded, double-buffered device workspace (README.md in this folder).
//
// The update is torch 2.x's `_single_tensor_adamw` (torch/optim/adam.py, FP32, amsgrad=False,
// maximize=False, capturable=False, decoupled weight decay) op for op, run as torch ops on the
// device; with the CPU as the device it is bitwise equal to torch 2.9.1's
// `torch.optim.AdamW(foreach=False)` given a correctly rounded sqrt (README.md, "The bitwise
// contract"), whatever the chunk size.

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace bragg::train {

class CopyWorker;

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  // FP32 elements per streamed chunk: the workspace holds two chunks (see workspace_bytes()).
  int64_t chunk_elements = int64_t{1} << 22;
  // Where the update runs (the parameters and their grads live there); host memory holds the
  // state, pinned when this is a CUDA device.
  torch::Device device = torch::kCPU;
  // > 0: scale the grads so that their global L2 norm is at most this (torch's
  // clip_grad_norm_), and report the norm in StepStats.
  double max_grad_norm = 0;
};

struct StepStats {
  double grad_norm = 0;        // the global grad norm before clipping; 0 when max_grad_norm == 0
  double seconds = 0;          // wall time of Step()
  int64_t bytes_streamed = 0;  // host<->workspace and workspace->param bytes copied
  // Device bytes the optimizer held during the step: the workspace plus the clipping norms.
  int64_t peak_workspace_bytes = 0;
  int64_t chunks = 0;
};

// Thread-compatible: one thread at a time calls its methods (it runs a copy thread of its own
// inside Step()). The parameters passed to Create must outlive the optimizer and keep their
// storage (the optimizer writes into them); their .grad() is read by Step().
class OffloadAdamW {
 public:
  // `named_params`: the model's parameters, each on options.device, float32 or bfloat16,
  // contiguous, requires_grad, with a distinct name and distinct storage. The master weights
  // start as FP32 copies of them, the moments at zero. InvalidArgument for an empty list, a
  // duplicate name, a parameter that breaks the rules above or bad options; FailedPrecondition
  // for a CUDA device in a libtorch without CUDA.
  [[nodiscard]] static Result<std::unique_ptr<OffloadAdamW>> Create(
      std::vector<std::pair<std::string, torch::Tensor>> named_params, const AdamWOptions& options);
  ~OffloadAdamW();
  OffloadAdamW(const OffloadAdamW&) = delete;
  OffloadAdamW& operator=(const OffloadAdamW&) = delete;

  // One AdamW step from each parameter's .grad(); a parameter without a grad is skipped as torch
  // does (its state and its own step count stay); grads are read, never changed (a
  // non-contiguous grad is first copied, on the device). Writes the new master weights into the
  // parameters, cast to their dtype (the master wins over any change made to a parameter between
  // steps). Without clipping a NaN grad goes into the state, as in torch. InvalidArgument for a
  // grad of the wrong size, device or dtype; with clipping, FailedPrecondition for a NaN/inf global
  // grad norm. On error nothing (state, step, parameters) has changed, except Internal (a torch
  // error mid-stream), which leaves the state undefined.
  [[nodiscard]] Result<StepStats> Step();

  void set_lr(double lr) { options_.lr = lr; }
  double lr() const { return options_.lr; }
  // Number of Step() calls that succeeded (or the step given to LoadState).
  int64_t step() const { return step_; }

  // Every state tensor by name, in parameter order: "<param>.master", "<param>.exp_avg",
  // "<param>.exp_avg_sq" (host FP32 tensors of the parameter's shape: views of the optimizer's
  // host state, which the next Step() overwrites: clone them to keep them), and "<param>.step"
  // (a 0-dim FP32 tensor, torch's per-parameter step count, as torch stores it).
  std::vector<std::pair<std::string, torch::Tensor>> StateTensors() const;

  // The inverse of StateTensors(): copies every "<param>.master/.exp_avg/.exp_avg_sq" in
  // (required, float32, the parameter's shape, any device) and "<param>.step" (optional; the
  // parameter's step count, `step` when absent), sets step() to `step`, and writes the masters
  // into the parameters (cast). InvalidArgument naming the tensor for a missing, unknown,
  // misshapen or non-float32 one, or a negative step; nothing changes then.
  [[nodiscard]] Status LoadState(const std::map<std::string, torch::Tensor>& state, int64_t step);

  // The device workspace's size, fixed at Create: two buffers, each of four FP32 arrays (master,
  // exp_avg, exp_avg_sq, grad) of min(chunk_elements, total parameter elements) elements, i.e.
  // 32 * min(chunk_elements, total) bytes. Nothing else of the optimizer's lives on the device but
  // the clipping norms (4 bytes per parameter, and their total) during a step.
  int64_t workspace_bytes() const;
  // Host bytes of the state (master, exp_avg, exp_avg_sq): 12 bytes per parameter element.
  int64_t state_bytes() const;
  int64_t total_elements() const { return total_; }

 private:
  struct Param {
    std::string name;
    torch::Tensor tensor;  // the parameter as given (Step() reads its .grad())
    torch::Tensor flat;    // the parameter, detached, viewed as 1-D (writes go here)
    std::vector<int64_t> shape;
    int64_t offset = 0;  // into the flat state
    int64_t numel = 0;
    int64_t step = 0;  // torch's per-parameter state["step"]
  };
  // A run of one parameter's elements inside one chunk.
  struct Segment {
    int param = 0;
    int64_t param_offset = 0;  // into the parameter
    int64_t chunk_offset = 0;  // into the chunk's workspace buffer
    int64_t length = 0;
  };
  // Per step: the grads (flat, detached; undefined for a skipped parameter) and what the update
  // needs.
  struct StepPlan {
    std::vector<torch::Tensor> grads;
    double clip_coef = 1.0;
    bool clip = false;
  };

  OffloadAdamW(std::vector<Param> params, const AdamWOptions& options, int64_t total);
  // The segments of chunk `c`, in order.
  std::vector<Segment> ChunkSegments(int64_t c) const;
  // Transfer side (runs on the copy worker): state and grads of chunk `c` into workspace buffer
  // `b`; the updated state of chunk `c` from buffer `b` to the host and the parameters. Return
  // the bytes copied.
  int64_t Load(const StepPlan& plan, int64_t c, int b);
  int64_t Store(const StepPlan& plan, int64_t c, int b);
  // Compute side: the AdamW update of chunk `c` in buffer `b`, on the device.
  void Update(const StepPlan& plan, int64_t c, int b);

  std::vector<Param> params_;
  AdamWOptions options_;
  int64_t total_ = 0;
  int64_t chunk_ = 0;  // min(chunk_elements, total_), at least 1
  int64_t step_ = 0;
  // Host state, flat over all parameters in order (pinned when the device is CUDA).
  torch::Tensor master_, exp_avg_, exp_avg_sq_;
  // Two workspace buffers on the device, each [4, chunk_]: master, exp_avg, exp_avg_sq, grad.
  torch::Tensor workspace_[2];
  std::unique_ptr<CopyWorker> worker_;
};

}  // namespace bragg::train
