#pragma once

// pbox-init under gVisor: commands in a PID namespace of their own, where pbox-init is not
// visible.
//
// gVisor does not honour PR_SET_DUMPABLE for /proc/PID/fd and /proc/PID/environ: a task of the
// same uid (every command: uid 0 without capabilities) could reopen pbox-init's fds through
// /proc/1/fd/N (its channel to the agent, other commands' stdio pipes) and read its
// environment. Here every later child of pbox-init is born in a new PID namespace whose PID 1
// is a holder process without fds or capabilities, whose environment holds only NUL bytes, and
// whose /proc shows only that namespace: pbox-init has no entry there at all.
//
// Kernel features used (all implemented by gVisor's kernel): unshare(CLONE_NEWNS |
// CLONE_NEWPID), mounting proc, PR_CAPBSET_DROP and a seccomp filter loaded by the process
// itself. pbox-init starts with CAP_SYS_ADMIN and CAP_SETPCAP for this and drops every
// capability before it serves; the seccomp filter (which would forbid the unshare) is loaded
// last.

#include <linux/filter.h>
#include <sys/types.h>

#include <span>
#include <string>
#include <vector>

#include "common/unique_fd.h"

namespace bragg::pbox {

struct CommandNamespace {
  // pbox-init's own /proc (its PID namespace), opened before the commands' proc was mounted
  // over /proc: for InitServerOptions::proc_dir. Close-on-exec.
  UniqueFd outer_proc;
  // The holder's pid (in pbox-init's namespace). When it dies the namespace is gone and no
  // command can start: pbox-init must shut down (InitServerOptions::exit_with_pid).
  pid_t holder = -1;
};

// Must run before anything else is forked, while pbox-init has no other thread. The holder is
// a clone of pbox-init that shares its memory but not its fds, credentials or signal state
// (CLONE_VM): no address space or image to set up, which under gVisor costs milliseconds. It
// mounts the namespace's proc on /proc, drops every capability, blocks every signal, closes
// every fd and only reaps orphans, through raw system calls (see HolderMain). pbox-init's
// environment strings, which the holder's /proc/1/environ would show, are overwritten first.
// `filter`: a classic BPF program (1..BPF_MAXINSNS instructions) that is loaded last, after
// every capability is dropped. Returns false and sets `*error` (naming the failed call) on any
// failure: the caller must then exit, since commands would not be isolated.
//
// What commands can learn of pbox-init through the holder: its command line, and from
// /proc/1/maps the layout of the memory they share (gVisor does not check dumpability
// there). Its memory itself stays closed: /proc/1/mem and ptrace need the mm to be dumpable,
// which pbox-init turned off at its start, and gVisor has no process_vm_readv.
bool EnterCommandNamespace(std::span<const sock_filter> filter, CommandNamespace* out,
                           std::string* error);

// Reads the program preamble (init_protocol.h) from `fd`, pbox-init's stdin under --isolate:
// exactly its bytes, none of the frames behind it. Returns false and sets `*error` when the
// length is refused or the channel ends or fails first.
bool ReadProgramPreamble(int fd, std::vector<sock_filter>* out, std::string* error);

}  // namespace bragg::pbox
