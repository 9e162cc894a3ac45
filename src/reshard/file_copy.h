#pragma once

// Positioned file-to-file copy primitives for the copy loop: pread/pwrite that finish the whole
// range, copy_file_range(2) that reports when the kernel cannot copy between the two files, and a
// read-only mapping of a file range.

#include <sys/uio.h>

#include <cstdint>
#include <string>

#include "common/status.h"

namespace bragg::reshard {

// Reads exactly `n` bytes at `off` of `fd` into `buf`, retrying on EINTR and short reads. Errors:
// the errno error of pread naming `name`; InvalidArgument when the file ends first.
[[nodiscard]] Status PreadAll(int fd, char* buf, uint64_t n, uint64_t off, const std::string& name);

// Writes exactly `n` bytes of `buf` at `off` of `fd`. Errors: the errno error of pwrite; EFAULT
// (the bytes come from a MappedRange whose file shrank) says so.
[[nodiscard]] Status PwriteAll(int fd, const char* buf, uint64_t n, uint64_t off,
                               const std::string& name);

// Writes the `iovcnt` buffers of `iov` (at most IOV_MAX) one after another at `off` of `fd`,
// retrying on EINTR and short writes. `iov` is modified (advanced past what was written). Errors:
// the errno error of pwritev naming `name`, as PwriteAll's.
[[nodiscard]] Status PwritevAll(int fd, struct iovec* iov, size_t iovcnt, uint64_t off,
                                const std::string& name);

// Copies up to `n` bytes from `in_off` of `in_fd` to `out_off` of `out_fd` inside the kernel
// (copy_file_range: a reflink, a page-cache-to-page-cache splice, or a server-side copy; no user
// buffer). Returns the bytes copied: fewer than `n` only when the kernel cannot copy between
// these files (EXDEV across file systems, EINVAL, ENOSYS, EOPNOTSUPP, ..., or 0 bytes copied
// before the end of the source), in which case the caller copies the rest another way. Errors:
// the errno error of any other failure (EIO, ENOSPC, ...); InvalidArgument when `in_name` ends
// before `in_off + n`.
[[nodiscard]] Result<uint64_t> CopyFileRangeAll(int in_fd, uint64_t in_off, int out_fd,
                                                uint64_t out_off, uint64_t n,
                                                const std::string& in_name,
                                                const std::string& out_name);

// A read-only, shared mapping of [off, off + len) of a file, unmapped on destruction. Its pages
// are the file's page cache: touching them costs no copy, and they count in the process's RSS
// only while mapped. Copy deleted, move transfers ownership; not thread-safe.
class MappedRange {
 public:
  MappedRange() = default;
  ~MappedRange() { Reset(); }
  MappedRange(const MappedRange&) = delete;
  MappedRange& operator=(const MappedRange&) = delete;
  MappedRange(MappedRange&& o) noexcept;
  MappedRange& operator=(MappedRange&& o) noexcept;

  // Maps [off, off + len) of `fd` (len > 0) and prefaults it (MAP_POPULATE: one pass that also
  // waits for the pages' reads, instead of a fault per page). The range must lie inside the
  // file: a mapping past the end would raise SIGBUS on access, so that is checked first
  // (InvalidArgument naming `name`). Errors: the errno error of fstat or mmap.
  [[nodiscard]] static Result<MappedRange> Map(int fd, uint64_t off, uint64_t len,
                                               const std::string& name);

  // The byte at `off` of the file.
  const char* data() const { return static_cast<const char*>(base_) + lead_; }

  void Reset();

  // Whether the `n` bytes at `at` (an offset from data()) equal `other`, read with a guard: if
  // the file shrinks under the mapping, touching a page past its new end raises SIGBUS, which
  // this turns into an error (FailedPrecondition naming `name`) instead of the end of the
  // process. (System calls that read the mapping, pwrite and pwritev, get EFAULT there
  // instead.) The first call installs a process-wide SIGBUS handler that hands every other
  // SIGBUS to the handler it replaced, or to the default action.
  [[nodiscard]] Result<bool> Equals(uint64_t at, const char* other, uint64_t n,
                                    const std::string& name) const;

 private:
  void* base_ = nullptr;
  uint64_t lead_ = 0;  // off minus the page-aligned start of the mapping
  uint64_t mapped_ = 0;
};

}  // namespace bragg::reshard
