#pragma once

// pbox-init's event loop: PID 1 of a native sandbox. It runs commands for the agent over the
// channel described in init_protocol.h, reaps every process of the sandbox, and kills them all
// when the channel closes.
//
// This file is linked into a static binary that runs inside the sandbox, so it uses only the
// C++ standard library, libc and header-only Bragg types (no absl, spdlog or fmt); errors are
// returned as strings and logged to stderr.

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "pbox/init/init_protocol.h"

namespace bragg::pbox {

struct InitServerOptions {
  // Where to scan for processes (Kill with whole_tree, shutdown). Tests may point it elsewhere.
  std::string proc_root = "/proc";
  // When valid, scanned instead of proc_root: pbox-init's own /proc once the commands' PID
  // namespace has its proc mounted on /proc (init_pid_namespace.h). Owned.
  UniqueFd proc_dir;
  // When this child is reaped, the server shuts down as after a channel error (the holder of
  // the commands' PID namespace: without it no command can start). -1: none.
  pid_t exit_with_pid = -1;
  // Used when a Spawn's env has no PATH.
  std::string default_path = "/usr/local/bin:/usr/bin:/bin";
};

// Single-threaded: one Run() per object, on the thread that created it. Not copyable.
class InitServer {
 public:
  // Takes ownership of `channel` (the init end of the SOCK_SEQPACKET socketpair). Blocks
  // SIGCHLD into a signalfd, ignores SIGPIPE, makes the process a child subreaper when it is
  // not PID 1, and makes sure fds 0-2 are open. Returns nullptr and sets `*error` when one of
  // those fails (not a socket, signalfd or prctl refused).
  static std::unique_ptr<InitServer> Create(UniqueFd channel, InitServerOptions options,
                                            std::string* error);
  // The stream transport (init_protocol.h; the gVisor runtime): frames arrive on `in` and
  // leave on `out` (pipes or stream sockets, pbox-init's stdin and stdout), each with a length
  // prefix; commands' stdio is relayed as Stdin/Output frames. Sends Ready first. Otherwise
  // as Create().
  static std::unique_ptr<InitServer> CreateStream(UniqueFd in, UniqueFd out,
                                                  InitServerOptions options, std::string* error);
  ~InitServer();
  InitServer(const InitServer&) = delete;
  InitServer& operator=(const InitServer&) = delete;

  // Serves the channel until it reads EOF or fails, then SIGKILLs every process it can (all of
  // the pid namespace when it is PID 1; otherwise every descendant, which reach it as a
  // subreaper) and returns the exit code for main(): 0 after a clean EOF, 1 after a channel
  // error. Malformed frames are logged to stderr and answered with an Error frame when their
  // id is readable; they never stop the loop.
  //
  // Kill with whole_tree signals the process group and every process whose session id is the
  // spawned pid. A descendant that called setsid() itself starts a new session and escapes
  // it (it is still killed when the channel closes).
  int Run();

 private:
  enum class State { kStarting, kRunning, kFailed };
  // What PumpOutput stopped at.
  enum class Pumped { kRead, kEmpty, kEof, kWindowFull };
  struct Child {
    uint64_t id = 0;
    pid_t pid = 0;
    State state = State::kStarting;
    UniqueFd err_pipe;  // read end of the child's CLOEXEC error pipe while kStarting
    std::optional<init_protocol::ExitedFrame> early_exit;  // reaped while still kStarting
  };

  // A streamed command's stdio as init holds it (stream transport). Lives until both output
  // pipes reached EOF, which may be after the process exited (a background child keeps them).
  struct Streams {
    UniqueFd stdin_write;  // non-blocking
    std::string stdin_pending;
    bool stdin_eof = false;  // close stdin once stdin_pending is written
    // Stdin bytes written (or dropped) and not yet credited back: with stdin_pending, what
    // the agent's stdin window holds (init_protocol.h).
    size_t stdin_uncredited = 0;
    bool stdin_refused = false;  // the agent overran its window: its stdin is ignored
    UniqueFd out[2];             // stdout, stderr read ends, non-blocking
    // Output bytes sent and not yet credited back: the pipe is not read while a stream's
    // window is full (init_protocol.h).
    size_t out_unacked[2] = {0, 0};
    // The process was reaped while output it wrote before exiting could not be sent yet (its
    // window was full): sent once each pipe was found empty (out_drained) or at EOF.
    std::optional<init_protocol::ExitedFrame> exit;
    bool out_drained[2] = {false, false};
  };

  InitServer(UniqueFd channel, UniqueFd out, UniqueFd signal_fd, InitServerOptions options,
             bool pid1, bool stream);
  // Sets up signals and fds 0-2 for Create and CreateStream.
  static UniqueFd PrepareProcess(std::string* error);

  // Returns false when the channel is gone (EOF or error).
  bool ReadChannel();
  bool ReadStream();
  void Dispatch(init_protocol::DecodeResult decoded, std::vector<UniqueFd> fds);
  void HandleStdin(init_protocol::StdinFrame frame);
  // Writes pending stdin; closes it after EOF or when the command stopped reading. Returns
  // credit to the agent for what left the buffer.
  void FlushStdin(uint64_t id);
  // Sends StdinCredit for `st`'s uncredited bytes once there are enough of them, or any once
  // its buffer is empty.
  void CreditStdin(uint64_t id, Streams& st);
  // Reads what the command wrote into `stream` (0 stdout, 1 stderr) and sends it, as far as
  // the stream's window allows; with `drain`, until the pipe is empty. Sends EOF and closes
  // the pipe at its end (which may forget the streams: callers look `id` up again).
  Pumped PumpOutput(uint64_t id, int stream, bool drain);
  void HandleOutputCredit(const init_protocol::OutputCreditFrame& frame);
  // The process `id` was reaped: forgets it and sends its Exited frame after the output it
  // wrote before exiting, at once or (window full) once FlushExit found its pipes drained.
  void FinishExit(const init_protocol::ExitedFrame& frame);
  void FlushExit(uint64_t id);
  void MaybeForgetStreams(uint64_t id);
  bool WriteChannel(const std::string& bytes);
  void HandleSpawn(init_protocol::SpawnFrame frame, std::vector<UniqueFd> fds);
  void HandleKill(const init_protocol::KillFrame& frame);
  void HandleErrorPipe(uint64_t id);
  void ReapChildren();
  void Send(const init_protocol::Frame& frame);
  void SendError(uint64_t id, const std::string& message);
  void Forget(uint64_t id);
  // One process as /proc/PID/stat describes it.
  struct ProcEntry {
    pid_t pid = 0;
    pid_t ppid = 0;
    pid_t pgrp = 0;
    pid_t session = 0;
    bool zombie = false;
  };
  // Every process under proc_root but this one (those that exit meanwhile are skipped).
  std::vector<ProcEntry> ScanProc() const;
  // Sends `signal` once to every process the command `root` started, however it detached: its
  // descendants (commands are child subreapers, so orphans stay descendants while the command
  // lives), its process group and session, and the sessions and groups its descendants made.
  // Rescans until a pass finds nobody new, so children forked during the kill are caught too.
  void KillTree(pid_t root, int signal);
  void KillEverything();

  UniqueFd channel_;
  UniqueFd out_;  // stream transport: where frames go (channel_ is then the read side)
  UniqueFd signal_fd_;
  InitServerOptions options_;
  const bool pid1_;
  const bool stream_;
  std::string stream_in_;  // stream transport: bytes read but not yet a whole frame
  std::map<uint64_t, Streams> streams_;
  bool channel_failed_ = false;
  bool channel_closed_ = false;
  std::vector<char> buffer_;
  std::map<uint64_t, Child> children_;
  std::map<pid_t, uint64_t> ids_by_pid_;
};

// Parses argv ("--channel-fd=N"; default 3; "--stream": the stream transport on fds 0 and 1).
// Returns false and sets `*error` on bad flags.
bool ParseInitFlags(int argc, char** argv, int* channel_fd, std::string* error,
                    bool* stream = nullptr);

}  // namespace bragg::pbox
