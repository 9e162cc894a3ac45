#pragma once

// Small file-system helpers with Status results, and owning types for a temp dir and a mount.

#include <sys/types.h>

#include <string>
#include <string_view>

#include "common/status.h"
#include "common/unique_fd.h"

namespace bragg {

// Opens `path` with `flags` (O_CLOEXEC is always added).
Result<UniqueFd> OpenFile(const std::string& path, int flags, mode_t mode = 0644);
Result<Pipe> MakePipe(int extra_flags = 0);

Result<std::string> ReadFileToString(const std::string& path);
// Writes (truncating) `data` to `path`, which must exist unless O_CREAT semantics are fine.
Status WriteStringToFile(const std::string& path, std::string_view data);
// Writes without O_CREAT/O_TRUNC: for cgroupfs and procfs control files.
Status WriteControlFile(const std::string& path, std::string_view data);

// mkdir -p. Existing directories are fine.
Status MakeDirs(const std::string& path, mode_t mode = 0755);

// rm -rf without following symlinks and without crossing into other mounts (a mount point
// found inside the tree fails the call with FailedPrecondition instead of being emptied).
// A missing path is OK.
Status RemoveTree(const std::string& path);

// Writes all of `data` to `fd`, retrying on EINTR and short writes.
Status WriteAll(int fd, std::string_view data);

// A directory created under `parent` (mkdtemp) and removed with RemoveTree on destruction.
// Move-only.
class TempDir {
 public:
  static Result<TempDir> Create(const std::string& parent = "/tmp",
                                const std::string& prefix = "bragg-");
  TempDir() = default;
  ~TempDir();
  TempDir(TempDir&& other) noexcept : path_(std::move(other.path_)) { other.path_.clear(); }
  TempDir& operator=(TempDir&& other) noexcept;
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // Gives up ownership (e.g. after renaming the directory into place) without removing it.
  std::string Release() { return std::exchange(path_, std::string()); }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Owns one mount point: unmounts it (MNT_DETACH) on destruction. Move-only.
class ScopedMount {
 public:
  // mount(2) with the given arguments; the mount is owned on success.
  static Result<ScopedMount> Mount(const std::string& source, const std::string& target,
                                   const std::string& fstype, unsigned long flags,
                                   const std::string& data = "");
  // Takes ownership of an existing mount point.
  static ScopedMount Adopt(std::string target) { return ScopedMount(std::move(target)); }

  ScopedMount() = default;
  ~ScopedMount();
  ScopedMount(ScopedMount&& other) noexcept : target_(std::move(other.target_)) {
    other.target_.clear();
  }
  ScopedMount& operator=(ScopedMount&& other) noexcept;
  ScopedMount(const ScopedMount&) = delete;
  ScopedMount& operator=(const ScopedMount&) = delete;

  const std::string& target() const { return target_; }
  // Unmounts now and reports the outcome.
  Status Unmount();
  // Gives up ownership without unmounting.
  std::string Release() { return std::exchange(target_, std::string()); }

 private:
  explicit ScopedMount(std::string target) : target_(std::move(target)) {}
  std::string target_;
};

}  // namespace bragg
