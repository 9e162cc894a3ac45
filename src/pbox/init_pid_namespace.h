#pragma once

// pbox-init under gVisor: commands in a PID namespace of their own, where pbox-init is not
// visible.
//
// gVisor does not honour PR_SET_DUMPABLE for /proc/PID/fd and /proc/PID/environ: a task of the
// same uid (every command: uid 0 without capabilities) could reopen pbox-init's fds through
// /proc/1/fd/N (its channel to the agent, other commands' stdio pipes) and read its
// environment. Here every later child of pbox-init is born in a new PID namespace whose PID 1
// is a holder process without fds, environment or dumpability, and whose /proc shows only that
// namespace: pbox-init has no entry there at all.
//
// Kernel features used (all implemented by gVisor's kernel): unshare(CLONE_NEWNS |
// CLONE_NEWPID), mounting proc, PR_CAPBSET_DROP and a seccomp filter loaded by the process
// itself. pbox-init starts with CAP_SYS_ADMIN and CAP_SETPCAP for this and drops every
// capability before it serves; the seccomp filter (which would forbid the unshare) is loaded
// last.

#include <sys/types.h>

#include <string>

#include "common/unique_fd.h"

namespace bragg::pbox {

// The flag that makes pbox-init re-execute itself as the holder (internal to pbox-init).
inline constexpr char kHolderFlag[] = "--pid-namespace-holder";

struct CommandNamespace {
  // pbox-init's own /proc (its PID namespace), opened before the commands' proc was mounted
  // over /proc: for InitServerOptions::proc_dir. Close-on-exec.
  UniqueFd outer_proc;
  // The holder's pid (in pbox-init's namespace). When it dies the namespace is gone and no
  // command can start: pbox-init must shut down (InitServerOptions::exit_with_pid).
  pid_t holder = -1;
};

// Must run before anything else is forked. pbox-init's own binary (/proc/self/exe) is
// re-executed, without environment, as the holder. `seccomp_file`: a classic BPF program
// (struct sock_filter[]) that is loaded last, after every capability is dropped; the file's
// mount is removed. Returns false and sets `*error` (naming the failed call) on any failure:
// the caller must then exit, since commands would not be isolated.
bool EnterCommandNamespace(const char* seccomp_file, CommandNamespace* out, std::string* error);

// main() of the holder (pbox-init started with kHolderFlag, fd 3 the readiness pipe): mounts
// the namespace's proc on /proc, reports "ok" on fd 3, closes every fd, drops every
// capability and reaps orphans forever. Exits 1 (with a message on stderr) when a step fails.
int HolderMain();

}  // namespace bragg::pbox
