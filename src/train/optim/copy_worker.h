#pragma once

// One background thread that runs one job at a time: the transfer side of the optimizer's double
// buffer when the device is the CPU (on a CUDA build the same role could be a copy stream).

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace bragg::train {

// Runs jobs, one at a time, on its own thread. Start() hands a job over (at most one in flight:
// Start() while a job runs is a programmer error); Wait() blocks until it is done and rethrows
// what it threw. Thread-compatible: one owner thread calls Start()/Wait(). The destructor waits
// for a running job and joins the thread.
class CopyWorker {
 public:
  CopyWorker();
  ~CopyWorker();
  CopyWorker(const CopyWorker&) = delete;
  CopyWorker& operator=(const CopyWorker&) = delete;

  void Start(std::function<void()> job);
  // Blocks until the job given to Start() finished; rethrows its exception, if any. A no-op
  // when no job was started.
  void Wait();

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;  // guarded by mu_
  bool pending_ = false;       // a job was started and not yet waited for; guarded by mu_
  bool running_ = false;       // job_ is set and not finished; guarded by mu_
  bool stop_ = false;          // guarded by mu_
  std::exception_ptr error_;   // guarded by mu_
  std::thread thread_;         // last: started after the fields above exist
};

}  // namespace bragg::train
