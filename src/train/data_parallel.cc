#include "train/data_parallel.h"

#include <chrono>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "common/str_cat.h"

namespace bragg::train {

struct DataParallel::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
};

DataParallel::DataParallel(std::unique_ptr<Impl> impl, int world, int rank)
    : impl_(std::move(impl)), world_(world), rank_(rank) {}
DataParallel::~DataParallel() = default;

Result<std::unique_ptr<DataParallel>> DataParallel::Join(int world, int rank,
                                                         const std::string& rendezvous,
                                                         double timeout_s) {
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        Cat("data parallel rank ", rank, " of ", world, ": need 0 <= rank < world size"));
  }
  auto impl = std::make_unique<Impl>();
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  try {
    if (rendezvous.rfind("file:", 0) == 0) {
      impl->store = c10::make_intrusive<c10d::FileStore>(rendezvous.substr(5), world);
    } else if (rendezvous.rfind("tcp:", 0) == 0) {
      std::string hp = rendezvous.substr(4);
      size_t colon = hp.rfind(':');
      if (colon == std::string::npos) {
        return absl::InvalidArgumentError(Cat("rendezvous ", rendezvous, ": want tcp:HOST:PORT"));
      }
      int port = std::atoi(hp.c_str() + colon + 1);
      if (port <= 0 || port > 65535) {
        return absl::InvalidArgumentError(Cat("rendezvous ", rendezvous, ": bad port"));
      }
      c10d::TCPStoreOptions o;
      o.port = static_cast<uint16_t>(port);
      o.isServer = rank == 0;
      o.numWorkers = world;
      o.waitWorkers = true;
      o.timeout = timeout;
      impl->store = c10::make_intrusive<c10d::TCPStore>(hp.substr(0, colon), o);
    } else {
      return absl::InvalidArgumentError(
          Cat("rendezvous \"", rendezvous, "\": want file:PATH or tcp:HOST:PORT"));
    }
    impl->store->setTimeout(timeout);
    auto opts = c10d::ProcessGroupGloo::Options::create();
    opts->timeout = timeout;
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    impl->group = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, rank, world, opts);
  } catch (const std::exception& e) {
    return absl::DeadlineExceededError(Cat("joining the data-parallel group (rank ", rank, " of ",
                                           world, " at ", rendezvous, "): ", e.what()));
  }
  return std::unique_ptr<DataParallel>(new DataParallel(std::move(impl), world, rank));
}

namespace {

Status Reduce(c10d::ProcessGroupGloo& g, std::vector<torch::Tensor>& tensors, c10d::ReduceOp op,
              const char* what) {
  try {
    for (torch::Tensor& t : tensors) {
      std::vector<at::Tensor> one = {t};
      c10d::AllreduceOptions o;
      o.reduceOp = op;
      g.allreduce(one, o)->wait();
    }
  } catch (const std::exception& e) {
    return absl::InternalError(Cat("all-reduce (", what, ") failed: ", e.what()));
  }
  return absl::OkStatus();
}

}  // namespace

Status DataParallel::AllReduceSum(std::vector<torch::Tensor>& tensors) {
  return Reduce(*impl_->group, tensors, c10d::ReduceOp::SUM, "sum");
}

Status DataParallel::AllReduceMax(std::vector<torch::Tensor>& tensors) {
  return Reduce(*impl_->group, tensors, c10d::ReduceOp::MAX, "max");
}

}  // namespace bragg::train
