#pragma once

// File-descriptor hygiene for pbox-init's processes (the server, the commands it forks, the
// PID namespace holder). Static pbox-init links this; nothing here allocates or sets errno
// (every system call is made directly, raw_syscall.h), so the holder, which shares
// pbox-init's memory and thread-local storage, may call it too.

#include <cstddef>
#include <string_view>

namespace bragg::pbox {

// Closes every fd >= `first`. One close_range(2) where the kernel has it; otherwise (older
// kernels, and gVisor releases without it) closes what /proc/self/fd lists, which costs a
// system call per open fd instead of one per possible fd: a loop to RLIMIT_NOFILE is a
// thousand system calls at the default limit and a million under a high one, each tens of
// microseconds under gVisor's ptrace platform. Falls back to that loop (capped at 65536) only
// when /proc cannot be read.
void CloseFdsFrom(int first);

// The fallback of CloseFdsFrom without trying close_range first: closes each fd >= `first`
// that /proc/self/fd lists (two passes). False when /proc/self/fd cannot be read (nothing
// was closed then, or not everything).
bool CloseFdsListedInProc(int first);

// Writes what the non-blocking `fd` takes of `data` now, retrying on EINTR, and returns how
// many bytes it took. Sets `*broken` when it failed otherwise than with EAGAIN (the reader is
// gone: EPIPE): nothing more of `data` will ever be taken.
size_t WriteAvailable(int fd, std::string_view data, bool* broken);

}  // namespace bragg::pbox
