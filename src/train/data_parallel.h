#pragma once

// Data parallelism for the trainer: a torch c10d process group (gloo, over TCP; NCCL is what a
// CUDA build would use) whose ranks each run their share of bragg_pack's plan and sum their
// gradients before every optimizer step. Torch's side: include only from torch translation units.

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::train {

class DataParallel {
 public:
  // Joins the group of `world_size` ranks as `rank`. `rendezvous`: "file:PATH" (a file every
  // rank on this machine can reach; removed by the last to leave) or "tcp:HOST:PORT" (rank 0
  // listens there). Blocks until every rank has joined or `timeout_s` passes (DeadlineExceeded).
  // InvalidArgument for a bad rank, size or rendezvous.
  static Result<std::unique_ptr<DataParallel>> Join(int world_size, int rank,
                                                    const std::string& rendezvous,
                                                    double timeout_s = 300);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }

  // Sums `tensors` (CPU, contiguous) over the ranks in place: each rank ends with the same
  // values. Every rank must call it with the same shapes in the same order. Internal (naming
  // the collective) when a peer fails or leaves.
  Status AllReduceSum(std::vector<torch::Tensor>& tensors);
  // The element-wise maximum over ranks, in place.
  Status AllReduceMax(std::vector<torch::Tensor>& tensors);

 private:
  struct Impl;
  DataParallel(std::unique_ptr<Impl> impl, int world, int rank);
  std::unique_ptr<Impl> impl_;
  int world_;
  int rank_;
};

}  // namespace bragg::train
