#pragma once

// File operations confined to one directory tree: a sandbox's root filesystem as the agent
// sees it. Every path is resolved by the kernel with openat2(RESOLVE_IN_ROOT |
// RESOLVE_NO_MAGICLINKS) against a directory fd of the root, so "..", absolute symlinks and
// symlinks swapped in during a call resolve inside the tree, never outside it. Operations on
// the last component use *at() calls relative to its parent's fd with no symlink following.

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/unique_fd.h"

namespace bragg::pbox {

enum class FileKind { kUnknown, kRegular, kDirectory, kSymlink, kOther };

struct FileStat {
  std::string name;  // the last path component (ListDir) or the path asked for (Stat)
  FileKind kind = FileKind::kUnknown;
  uint64_t size = 0;
  uint32_t mode = 0;  // permission bits only
  int64_t mtime_ns = 0;
  std::string symlink_target;
};

// A regular file being written under a temporary name (".pbox-upload-<random>") in the
// directory of its destination. Commit renames it over the destination in one step; destroyed
// uncommitted, it removes itself, so a failed upload leaves nothing behind. Move-only; not
// thread-safe (one owner at a time).
class PendingFile {
 public:
  PendingFile(PendingFile&& other) noexcept;
  PendingFile& operator=(PendingFile&& other) noexcept;
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;
  ~PendingFile();

  // The temporary file, open for writing.
  int fd() const { return fd_.get(); }
  // The destination as the caller named it, for messages.
  const std::string& display() const { return display_; }
  // Sets the permission bits (`mode` for a new file; a file that existed keeps its own), then
  // renames the file over the destination (a symlink in the last place was followed when the
  // file was created; a directory there is an error). After an error the file is still pending.
  Status Commit(uint32_t mode);

 private:
  friend class SandboxFs;
  PendingFile(UniqueFd dir, UniqueFd fd, std::string temp, std::string name, std::string display)
      : dir_(std::move(dir)),
        fd_(std::move(fd)),
        temp_(std::move(temp)),
        name_(std::move(name)),
        display_(std::move(display)) {}
  void Discard();

  UniqueFd dir_;  // O_PATH fd of the destination's directory
  UniqueFd fd_;
  std::string temp_;  // empty once committed or discarded
  std::string name_;
  std::string display_;
  std::optional<uint32_t> keep_mode_;  // the permission bits of the file it replaces
};

// Thread-safe: holds only an fd; every call is independent.
class SandboxFs {
 public:
  // Opens `root` (a directory). NotFound / InvalidArgument if it is not one.
  static Result<SandboxFs> Open(const std::string& root);

  SandboxFs(SandboxFs&&) = default;
  SandboxFs& operator=(SandboxFs&&) = default;

  // Paths are taken as inside the root: "/a/b" and "a/b" are the same; "" is the root.
  // Paths longer than PATH_MAX or holding a NUL byte are InvalidArgument.

  // lstat of the path (a symlink is reported as one, with its target).
  Result<FileStat> Stat(std::string_view path) const;
  // Opens a regular file for reading (following symlinks inside the root).
  // InvalidArgument for directories, FIFOs, sockets and devices (never blocks on a FIFO).
  Result<UniqueFd> OpenRead(std::string_view path) const;
  // Opens for writing, creating (mode) or truncating unless `append`. With `make_parents`,
  // missing directories are created 0755. Same refusals as OpenRead.
  Result<UniqueFd> OpenWrite(std::string_view path, uint32_t mode, bool make_parents,
                             bool append) const;
  // A new empty file beside `path` that PendingFile::Commit later renames to `path`: the
  // atomic form of OpenWrite. InvalidArgument if `path` names the root, a directory, or
  // (after symlinks) anything else but a regular file, as OpenWrite refuses them;
  // errors of resolving the parent as OpenWrite.
  Result<PendingFile> CreatePending(std::string_view path, bool make_parents) const;
  // Entries sorted by name, without "." and "..".
  Result<std::vector<FileStat>> ListDir(std::string_view path) const;
  Status MakeDir(std::string_view path, uint32_t mode, bool parents) const;
  // Removes a file, symlink or empty directory; with `recursive` a whole tree, never
  // following symlinks. Removing the root itself is InvalidArgument.
  Status Remove(std::string_view path, bool recursive) const;
  // rename; with `no_replace`, AlreadyExists if dst exists.
  Status Move(std::string_view src, std::string_view dst, bool no_replace) const;

  int root_fd() const { return root_.get(); }

 private:
  explicit SandboxFs(UniqueFd root) : root_(std::move(root)) {}
  UniqueFd root_;
};

// Kernel pseudo-filesystems (proc, sysfs, cgroupfs, debugfs, securityfs, bpffs) that the
// agent, which runs with every capability, must not read or write through on a client's
// behalf, whatever the path looked like: PermissionDenied when `fd` is on one of them.
Status RefusePseudoFs(int fd, std::string_view path);

}  // namespace bragg::pbox
