#pragma once

// The agent's end of the control channel to pbox-init, PID 1 of every sandbox.
//
// Two transports, one API (init_protocol.h):
// - seqpacket (native runtime, Create): one message per frame, with the command's
//   stdin/stdout/stderr passed as file descriptors (SCM_RIGHTS) so that output flows from the
//   command to the agent directly, never copied through init.
// - stream (gVisor runtime, CreateStream; fds cannot cross into gVisor): length-prefixed
//   frames over two byte streams. The client relays the caller's stdio fds itself: a thread
//   per command with stdin sends what it reads as Stdin frames, and one writer thread puts
//   Output frames into the caller's stdout/stderr fds (its own non-blocking descriptions of
//   them, closed at the stream's EOF). Both directions are flow-controlled per command
//   (init_protocol.h): a command whose caller stops reading its output blocks on its pipe in
//   the sandbox, as on the native runtime, and holds up no other command. Callers see the
//   same fds, handles and exits on both; a handle completes only once the output that
//   preceded the exit is in the caller's pipes (or the caller's reader closed them).
//
// If the channel closes (the agent died), pbox-init exits and the kernel kills every process
// of the sandbox's pid namespace with it.

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"
#include "pbox/init/init_protocol.h"

namespace bragg::pbox {

struct SpawnRequest {
  std::vector<std::string> argv;  // argv[0] looked up in PATH from env
  std::vector<std::string> env;   // "K=V"
  std::string cwd;                // absolute inside the sandbox; "" = "/"
  int stdin_fd = -1;              // borrowed; -1: /dev/null
  // Borrowed; -1: /dev/null. Stream transport: a pipe is reopened as the client's own
  // non-blocking description; any other kind of fd is duplicated and set O_NONBLOCK, which
  // its other descriptors share.
  int stdout_fd = -1;
  int stderr_fd = -1;
};

struct ProcessExit {
  int exit_code = -1;  // valid when signal == 0
  int signal = 0;
  int64_t user_us = 0;  // rusage of the process and its waited-for children
  int64_t system_us = 0;
  int64_t max_rss_kb = 0;
  int spawn_errno = 0;  // non-zero: the program never ran (exit_code is then 127)
  std::string error;    // e.g. "execvp(foo): No such file or directory"
};

// One spawned process. Thread-safe.
class ProcessHandle {
 public:
  uint64_t id() const { return id_; }
  pid_t pid() const { return pid_; }  // inside the sandbox's pid namespace
  // Blocks until the process exited (or the channel died: Unavailable). `timeout` nullopt:
  // forever; DeadlineExceeded if still running.
  Result<ProcessExit> Wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  bool done() const;
  // An eventfd that becomes readable once the process exited (for poll loops). Owned here.
  int done_fd() const { return done_fd_.get(); }

 private:
  friend class InitClient;
  ProcessHandle(uint64_t id, pid_t pid, UniqueFd done_fd)
      : id_(id), pid_(pid), done_fd_(std::move(done_fd)) {}
  void Complete(Result<ProcessExit> exit);

  const uint64_t id_;
  const pid_t pid_;
  UniqueFd done_fd_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Result<ProcessExit>> exit_;
};

// Thread-safe. Destruction closes the channel (which makes init, and the sandbox, exit).
class InitClient {
 public:
  // Takes the agent's end of the socketpair and starts a reader thread.
  static Result<std::unique_ptr<InitClient>> Create(UniqueFd channel);
  // The stream transport: frames go to `to_init` and come from `from_init` (pipes or stream
  // sockets). Starts the reader thread.
  static Result<std::unique_ptr<InitClient>> CreateStream(UniqueFd to_init, UniqueFd from_init);
  ~InitClient();

  // Stream transport: blocks until pbox-init said Ready. Unavailable if the channel closed
  // first (init or its runtime failed), DeadlineExceeded after `timeout`. OK at once on the
  // seqpacket transport.
  Status WaitReady(std::chrono::milliseconds timeout);

  // Starts a process. Returns once init has forked it (the pid is known) or failed to.
  // A program that cannot be executed still yields a handle, whose exit has spawn_errno set.
  // InvalidArgument for empty argv or argv+env over kMaxSpawnBytes; Unavailable if the
  // channel is closed.
  Result<std::shared_ptr<ProcessHandle>> Spawn(const SpawnRequest& request);
  // Sends `signal` to the process's group; with `whole_tree`, also to every process of the
  // sandbox in its session (what a timeout kill uses). Fire-and-forget: the outcome shows up
  // in the handle's exit. NotFound if the process is not running (exited or never spawned),
  // InvalidArgument for a signal outside 0..64, Unavailable if the channel is closed.
  Status Kill(uint64_t process_id, int signal, bool whole_tree);
  // True while the channel is open (init alive).
  bool alive() const { return alive_.load(); }
  // Stream transport: threads relaying stdin not yet joined (those of running commands, and
  // at most the ones that ended since the last Spawn).
  size_t stdin_pumps() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pumps_.size();
  }

  static constexpr size_t kMaxSpawnBytes = 256 * 1024;

 private:
  explicit InitClient(UniqueFd channel);
  InitClient(UniqueFd to_init, UniqueFd from_init);
  void ReaderLoop();
  // Stream transport: reads one whole frame (prefix stripped) into `frame`; false at EOF or
  // on an error (logged).
  bool ReadStreamFrame(std::string* frame);
  void HandleFrame(init_protocol::Frame frame);
  // Stream transport: queues one Output frame's data for the caller's fd (never blocks).
  // Called with mu_ held.
  void HandleOutput(init_protocol::OutputFrame frame);
  // Stream transport: the writer thread: moves queued output into the callers' pipes as
  // they take it, returns credit for it, and completes the exits that waited for it.
  void WriterLoop();
  void WakeWriter();
  // Stream transport: one thread relaying a command's stdin; `finished` (under mu_) once it
  // returned, when the next Spawn joins it.
  struct StdinPumpThread {
    std::thread thread;
    bool finished = false;
  };
  // Stream transport: relays `stdin_fd` (owned) to process `id` until EOF or shutdown.
  void StdinPump(uint64_t id, UniqueFd stdin_fd, StdinPumpThread* self);
  // Completes every pending Spawn and live handle with Unavailable; marks the client dead.
  void ChannelDied();
  // One sendmsg of a whole frame, with `fds` as SCM_RIGHTS.
  Status SendFrame(const std::string& bytes, const std::vector<int>& fds);

  UniqueFd channel_;  // seqpacket: both ways; stream: from init
  UniqueFd to_init_;  // stream transport only
  const bool stream_ = false;
  std::mutex send_mu_;                // stream transport: one frame at a time on the byte stream
  UniqueFd stop_fd_;                  // stream transport: eventfd that stops the stdin pumps
  std::list<StdinPumpThread> pumps_;  // guarded by mu_; stable addresses for `self`
  // Stream transport: the stdin window of each command with a stdin pump (init_protocol.h):
  // how many more bytes it may send before init credits some back. Guarded by mu_.
  struct StdinWindow {
    size_t credit = init_protocol::kStdioWindowBytes;
    bool closed = false;  // the command exited: the pump stops
    UniqueFd wake;        // eventfd written when `closed` is set, for the pump's poll
  };
  std::map<uint64_t, StdinWindow> stdin_windows_;
  std::condition_variable stdin_cv_;  // with mu_: a window changed, or stopping_
  bool stopping_ = false;             // guarded by mu_: the pumps return
  // Stream transport: one output stream of a command on its way to the caller's pipe.
  struct OutputSink {
    UniqueFd fd;            // non-blocking; invalid once closed (or /dev/null)
    std::string queue;      // received, not yet written (at most the window)
    bool eof = false;       // init said EOF (or there is no pipe): close once written
    size_t uncredited = 0;  // written (or dropped) and not yet credited back to init
  };
  struct CommandOutput {
    OutputSink sinks[2];  // stdout, stderr
    // An Exited frame that came while output was still queued: the handle completes once
    // the queues are written.
    std::shared_ptr<ProcessHandle> exited;
    ProcessExit exit;
  };
  // Guarded by mu_; the writer thread erases entries once both streams ended and all is
  // written and credited.
  std::map<uint64_t, CommandOutput> outputs_;
  UniqueFd writer_wake_;      // stream transport: eventfd that wakes the writer thread
  bool writer_stop_ = false;  // guarded by mu_: the destructor stops the writer
  std::thread writer_;
  bool ready_ = false;
  std::condition_variable ready_cv_;
  std::atomic<bool> alive_{true};
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::shared_ptr<ProcessHandle>> live_;
  struct PendingSpawn;
  std::map<uint64_t, PendingSpawn*> pending_;
  std::thread reader_;
};

}  // namespace bragg::pbox
