#include "common/fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "fmt/format.h"

namespace bragg {

Result<UniqueFd> OpenFile(const std::string& path, int flags, mode_t mode) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  if (fd < 0) {
    return ErrnoError("open", path);
  }
  return UniqueFd(fd);
}

Result<Pipe> MakePipe(int extra_flags) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | extra_flags) != 0) {
    return ErrnoError("pipe2", "");
  }
  return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
}

Result<std::string> ReadFileToString(const std::string& path) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
  std::string out;
  char buf[16384];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return ErrnoError("read", path);
    }
    if (n == 0) {
      break;
    }
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

Status WriteAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return ErrnoError("write", fmt::format("fd {}", fd));
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

Status WriteStringToFile(const std::string& path, std::string_view data) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC));
  return Annotate(WriteAll(fd.get(), data), path);
}

Status WriteControlFile(const std::string& path, std::string_view data) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_WRONLY));
  // Control files take one write; a short or split write would be two commands.
  ssize_t n = ::write(fd.get(), data.data(), data.size());
  if (n < 0) {
    return ErrnoError("write", fmt::format("{} <- {}", path, data));
  }
  return absl::OkStatus();
}

Status MakeDirs(const std::string& path, mode_t mode) {
  if (path.empty()) {
    return absl::InvalidArgumentError("MakeDirs: empty path");
  }
  for (size_t pos = 1;; ++pos) {
    pos = path.find('/', pos);
    std::string prefix = path.substr(0, pos);
    if (::mkdir(prefix.c_str(), mode) != 0 && errno != EEXIST) {
      return ErrnoError("mkdir", prefix);
    }
    if (pos == std::string::npos) {
      break;
    }
  }
  return absl::OkStatus();
}

namespace {

Status RemoveTreeAt(int parent_fd, const char* name, const std::string& display, dev_t dev) {
  struct stat st;
  if (::fstatat(parent_fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoError("fstatat", display);
  }
  if (!S_ISDIR(st.st_mode)) {
    if (::unlinkat(parent_fd, name, 0) != 0 && errno != ENOENT) {
      return ErrnoError("unlinkat", display);
    }
    return absl::OkStatus();
  }
  if (st.st_dev != dev) {
    return absl::FailedPreconditionError(
        fmt::format("refusing to remove {}: it is a mount point", display));
  }
  UniqueFd fd(::openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) {
    return ErrnoError("openat", display);
  }
  UniqueDir dir(::fdopendir(fd.get()));
  if (dir == nullptr) {
    return ErrnoError("fdopendir", display);
  }
  (void)fd.Release();  // the stream owns it now
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(dir.get())) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
      names.emplace_back(e->d_name);
    }
  }
  Status status;
  for (const std::string& child : names) {
    status.Update(RemoveTreeAt(::dirfd(dir.get()), child.c_str(), display + "/" + child, dev));
  }
  dir.reset();
  if (!status.ok()) {
    return status;
  }
  if (::unlinkat(parent_fd, name, AT_REMOVEDIR) != 0 && errno != ENOENT) {
    return ErrnoError("rmdir", display);
  }
  return absl::OkStatus();
}

}  // namespace

Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoError("lstat", path);
  }
  return RemoveTreeAt(AT_FDCWD, path.c_str(), path, st.st_dev);
}

Result<TempDir> TempDir::Create(const std::string& parent, const std::string& prefix) {
  std::string tmpl = fmt::format("{}/{}XXXXXX", parent, prefix);
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return ErrnoError("mkdtemp", tmpl);
  }
  return TempDir(std::move(tmpl));
}

TempDir::~TempDir() {
  if (!path_.empty()) {
    (void)RemoveTree(path_);
  }
}

TempDir& TempDir::operator=(TempDir&& other) noexcept {
  if (this != &other) {
    if (!path_.empty()) {
      (void)RemoveTree(path_);
    }
    path_ = std::exchange(other.path_, std::string());
  }
  return *this;
}

Result<ScopedMount> ScopedMount::Mount(const std::string& source, const std::string& target,
                                       const std::string& fstype, unsigned long flags,
                                       const std::string& data) {
  if (::mount(source.c_str(), target.c_str(), fstype.empty() ? nullptr : fstype.c_str(), flags,
              data.empty() ? nullptr : data.c_str()) != 0) {
    return ErrnoError("mount", fmt::format("{} at {}", fstype.empty() ? source : fstype, target));
  }
  return ScopedMount(target);
}

ScopedMount::~ScopedMount() { (void)Unmount(); }

ScopedMount& ScopedMount::operator=(ScopedMount&& other) noexcept {
  if (this != &other) {
    (void)Unmount();
    target_ = std::exchange(other.target_, std::string());
  }
  return *this;
}

Status ScopedMount::Unmount() {
  if (target_.empty()) {
    return absl::OkStatus();
  }
  std::string target = std::exchange(target_, std::string());
  if (::umount2(target.c_str(), MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT) {
    return ErrnoError("umount2", target);
  }
  return absl::OkStatus();
}

}  // namespace bragg
