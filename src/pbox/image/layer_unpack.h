#pragma once

// Unpacking one image layer (a tar archive, plain or compressed) into a directory, safely
// against hostile archives.
//
// Every entry is created relative to a directory fd: parents are opened with openat2
// (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV), the entry
// itself with O_NOFOLLOW/O_EXCL or the *at calls that never follow a final symlink. So an
// archive cannot write outside the destination: absolute paths and ".." components are
// refused, a symlink planted by an earlier entry is never written through, hard links must
// name an earlier regular file or symlink of the same layer, and relative symlink targets may
// not climb above the layer's root. Character and block devices, sockets and unknown entry
// types are refused; OverlayFS whiteouts are made by the unpacker from the OCI/Docker
// conventions (".wh.NAME" -> a 0:0 character device NAME, ".wh..wh..opq" -> the directory
// gets trusted.overlay.opaque=y), never taken from the archive. Of extended attributes only
// "user.*" and "security.capability" are kept.

#include <archive.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace bragg::pbox {

struct ArchiveFree {
  void operator()(struct archive* a) const;
};
// An archive reader (libarchive), freed on destruction.
using ArchivePtr = std::unique_ptr<struct archive, ArchiveFree>;

// Opens `path` for reading as a tar archive (ustar, pax, GNU) behind any compression
// libarchive knows (gzip, zstd, xz, bzip2, ...). InvalidArgument if it is not one.
Result<ArchivePtr> OpenTarArchive(const std::string& path);

// libarchive's message for the last error of `a`, or "unknown error" where it has none
// (archive_error_string returns NULL then, which fmt refuses with an exception).
std::string ArchiveErrorString(struct archive* a);

struct UnpackLimits {
  uint64_t max_bytes = 4ull << 30;  // sum of the sizes of the regular files
  uint64_t max_entries = 2'000'000;
  // Unpacking without root, for an overlay mounted in a user namespace with `userxattr`:
  // every file is the caller's (the archive's owners are dropped), the opaque marker is
  // user.overlay.opaque, and file capabilities are dropped.
  bool rootless = false;
};

struct LayerStats {
  uint64_t bytes = 0;  // sum of the sizes of the regular files
  uint64_t entries = 0;
};

// Unpacks the tar at `archive_path` into `dest`, an existing empty directory the caller
// owns (and removes on failure: a failed unpack leaves a partial tree behind). Errors:
// InvalidArgument naming the offending entry for a hostile or malformed archive,
// ResourceExhausted past `limits`, the errno's code for I/O failures. Must run as root
// (ownership, trusted.* xattrs) unless `limits.rootless`.
Result<LayerStats> UnpackLayer(const std::string& archive_path, const std::string& dest,
                               const UnpackLimits& limits);

}  // namespace bragg::pbox
