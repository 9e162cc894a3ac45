#include "train/optim/copy_worker.h"

#include <cassert>
#include <utility>

namespace bragg::train {

CopyWorker::CopyWorker() : thread_([this] { Loop(); }) {}

CopyWorker::~CopyWorker() {
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return !running_; });
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void CopyWorker::Start(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    assert(!pending_ && "CopyWorker::Start while a job is in flight");
    job_ = std::move(job);
    pending_ = true;
    running_ = true;
    error_ = nullptr;
  }
  cv_.notify_all();
}

void CopyWorker::Wait() {
  std::exception_ptr error;
  {
    std::unique_lock lock(mu_);
    if (!pending_) {
      return;
    }
    cv_.wait(lock, [this] { return !running_; });
    pending_ = false;
    error = std::exchange(error_, nullptr);
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

void CopyWorker::Loop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || running_; });
    if (stop_) {
      return;
    }
    std::function<void()> job = std::move(job_);
    lock.unlock();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    error_ = error;
    running_ = false;
    cv_.notify_all();
  }
}

}  // namespace bragg::train
