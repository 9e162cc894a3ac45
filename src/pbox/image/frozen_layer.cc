#include "pbox/image/frozen_layer.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <map>
#include <utility>

#include "common/fs.h"
#include "common/unique_fd.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

// Deeper trees are refused: two fds stay open per level while the copy descends.
constexpr int kMaxTreeDepth = 256;

struct CopyContext {
  int dst_root = -1;
  // (dev, ino) of a multiply-linked source file -> its path in the copy, for linkat.
  std::map<std::pair<dev_t, ino_t>, std::string> links;
  uint64_t files = 0;
  uint64_t bytes = 0;
};

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

// "/proc/self/fd/N/name": the only way to reach the xattrs of a symlink or a device node
// relative to a directory fd (there is no lgetxattrat before Linux 6.13).
std::string FdPath(int dir, const std::string& name) {
  return fmt::format("/proc/self/fd/{}/{}", dir, name);
}

// Copies every extended attribute. `src_fd`/`dst_fd` are used when >= 0, else the paths
// (without following a final symlink).
Status CopyXattrs(int src_fd, const std::string& src_path, int dst_fd, const std::string& dst_path,
                  const std::string& what) {
  auto list = [&](char* buf, size_t size) {
    return src_fd >= 0 ? ::flistxattr(src_fd, buf, size)
                       : ::llistxattr(src_path.c_str(), buf, size);
  };
  ssize_t n = list(nullptr, 0);
  if (n < 0) {
    // A filesystem without xattrs has none to copy.
    return errno == ENOTSUP ? absl::OkStatus() : ErrnoError("listxattr", what);
  }
  if (n == 0) {
    return absl::OkStatus();
  }
  std::string names(static_cast<size_t>(n), '\0');
  n = list(names.data(), names.size());
  if (n < 0) {
    return ErrnoError("listxattr", what);
  }
  names.resize(static_cast<size_t>(n));
  std::string value;
  for (size_t pos = 0; pos < names.size();) {
    std::string name(names.c_str() + pos);
    pos += name.size() + 1;
    if (name.empty()) {
      continue;
    }
    auto get = [&](void* buf, size_t size) {
      return src_fd >= 0 ? ::fgetxattr(src_fd, name.c_str(), buf, size)
                         : ::lgetxattr(src_path.c_str(), name.c_str(), buf, size);
    };
    ssize_t len = get(nullptr, 0);
    if (len < 0) {
      if (errno == ENODATA) {
        continue;  // removed meanwhile
      }
      return ErrnoError("getxattr", fmt::format("{} {}", what, name));
    }
    value.resize(static_cast<size_t>(len));
    len = get(value.data(), value.size());
    if (len < 0) {
      return ErrnoError("getxattr", fmt::format("{} {}", what, name));
    }
    value.resize(static_cast<size_t>(len));
    int rc = dst_fd >= 0
                 ? ::fsetxattr(dst_fd, name.c_str(), value.data(), value.size(), 0)
                 : ::lsetxattr(dst_path.c_str(), name.c_str(), value.data(), value.size(), 0);
    if (rc != 0) {
      return ErrnoError("setxattr", fmt::format("{} {}", what, name));
    }
  }
  return absl::OkStatus();
}

// Owner, then mode (chown clears setuid bits), then xattrs and times of an open file or dir.
Status CopyMetadata(int src_fd, int dst_fd, const struct stat& st, const std::string& what) {
  if (::fchown(dst_fd, st.st_uid, st.st_gid) != 0) {
    return ErrnoError("fchown", what);
  }
  if (::fchmod(dst_fd, st.st_mode & 07777) != 0) {
    return ErrnoError("fchmod", what);
  }
  BRAGG_RETURN_IF_ERROR(CopyXattrs(src_fd, "", dst_fd, "", what));
  struct timespec times[2] = {st.st_atim, st.st_mtim};
  if (::futimens(dst_fd, times) != 0) {
    return ErrnoError("futimens", what);
  }
  return absl::OkStatus();
}

// The same for an entry that cannot be opened (symlink, whiteout, fifo, socket).
Status CopyMetadataAt(int src_dir, int dst_dir, const std::string& name, const struct stat& st,
                      const std::string& what) {
  if (::fchownat(dst_dir, name.c_str(), st.st_uid, st.st_gid, AT_SYMLINK_NOFOLLOW) != 0) {
    return ErrnoError("fchownat", what);
  }
  if (!S_ISLNK(st.st_mode) && ::fchmodat(dst_dir, name.c_str(), st.st_mode & 07777, 0) != 0) {
    return ErrnoError("fchmodat", what);
  }
  BRAGG_RETURN_IF_ERROR(CopyXattrs(-1, FdPath(src_dir, name), -1, FdPath(dst_dir, name), what));
  struct timespec times[2] = {st.st_atim, st.st_mtim};
  if (::utimensat(dst_dir, name.c_str(), times, AT_SYMLINK_NOFOLLOW) != 0) {
    return ErrnoError("utimensat", what);
  }
  return absl::OkStatus();
}

Status CopyData(int in, int out, uint64_t size, const std::string& what, CopyContext& ctx) {
  // sendfile copies file to file in the kernel across filesystems (tmpfs -> ext4), which
  // copy_file_range refuses with EXDEV.
  uint64_t done = 0;
  while (true) {
    ssize_t n = ::sendfile(out, in, nullptr, 1 << 30);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      if ((errno == EINVAL || errno == ENOSYS) && done == 0) {
        break;  // no sendfile between these files: read and write
      }
      return ErrnoError("sendfile", what);
    }
    if (n == 0) {
      ctx.bytes += done;
      return absl::OkStatus();
    }
    done += static_cast<uint64_t>(n);
  }
  std::string buf(256 << 10, '\0');
  while (true) {
    ssize_t n = ::read(in, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      return ErrnoError("read", what);
    }
    if (n == 0) {
      break;
    }
    BRAGG_RETURN_IF_ERROR(
        Annotate(WriteAll(out, std::string_view(buf.data(), static_cast<size_t>(n))), what));
    done += static_cast<uint64_t>(n);
  }
  (void)size;
  ctx.bytes += done;
  return absl::OkStatus();
}

Status CopyDir(int src, int dst, const std::string& rel, int depth, CopyContext& ctx);

Status CopyEntry(int src, int dst, const std::string& rel, const std::string& name, int depth,
                 CopyContext& ctx) {
  std::string path = Join(rel, name);
  std::string what = "/" + path;
  struct stat st;
  if (::fstatat(src, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) {
      return absl::OkStatus();  // gone since readdir (the source was not frozen)
    }
    return ErrnoError("fstatat", what);
  }
  ++ctx.files;
  switch (st.st_mode & S_IFMT) {
    case S_IFDIR: {
      if (depth >= kMaxTreeDepth) {
        return absl::FailedPreconditionError(fmt::format(
            "{}: the writable layer is nested deeper than {} directories", what, kMaxTreeDepth));
      }
      if (::mkdirat(dst, name.c_str(), 0700) != 0) {
        return ErrnoError("mkdir", what);
      }
      int s = ::openat(src, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (s < 0) {
        return ErrnoError("open", what);
      }
      UniqueFd src_sub(s);
      int d = ::openat(dst, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (d < 0) {
        return ErrnoError("open", what);
      }
      UniqueFd dst_sub(d);
      BRAGG_RETURN_IF_ERROR(CopyDir(src_sub.get(), dst_sub.get(), path, depth + 1, ctx));
      // After the contents: the directory's mtime, and a mode that may forbid writing.
      return CopyMetadata(src_sub.get(), dst_sub.get(), st, what);
    }
    case S_IFREG: {
      if (st.st_nlink > 1) {
        auto [it, fresh] = ctx.links.emplace(std::pair{st.st_dev, st.st_ino}, path);
        if (!fresh) {
          if (::linkat(ctx.dst_root, it->second.c_str(), dst, name.c_str(), 0) != 0) {
            return ErrnoError("link", what);
          }
          return absl::OkStatus();
        }
      }
      int s = ::openat(src, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY);
      if (s < 0) {
        return ErrnoError("open", what);
      }
      UniqueFd in(s);
      int d =
          ::openat(dst, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (d < 0) {
        return ErrnoError("create", what);
      }
      UniqueFd out(d);
      BRAGG_RETURN_IF_ERROR(
          CopyData(in.get(), out.get(), static_cast<uint64_t>(st.st_size), what, ctx));
      return CopyMetadata(in.get(), out.get(), st, what);
    }
    case S_IFLNK: {
      std::string target(static_cast<size_t>(st.st_size) + 1, '\0');
      ssize_t n = ::readlinkat(src, name.c_str(), target.data(), target.size());
      if (n < 0) {
        return ErrnoError("readlink", what);
      }
      target.resize(static_cast<size_t>(n));
      if (::symlinkat(target.c_str(), dst, name.c_str()) != 0) {
        return ErrnoError("symlink", what);
      }
      return CopyMetadataAt(src, dst, name, st, what);
    }
    case S_IFCHR:
    case S_IFBLK:
      // OverlayFS whiteout: a file the sandbox deleted from a lower layer. It must hide that
      // file in every clone too.
      if (S_ISCHR(st.st_mode) && major(st.st_rdev) == 0 && minor(st.st_rdev) == 0) {
        if (::mknodat(dst, name.c_str(), S_IFCHR | 0600, makedev(0, 0)) != 0) {
          return ErrnoError("mknod", what);
        }
        return CopyMetadataAt(src, dst, name, st, what);
      }
      spdlog::warn("frozen layer: skipping device node {}", what);
      return absl::OkStatus();
    case S_IFIFO:
    case S_IFSOCK:
      if (::mknodat(dst, name.c_str(), (st.st_mode & S_IFMT) | 0600, 0) != 0) {
        return ErrnoError("mknod", what);
      }
      return CopyMetadataAt(src, dst, name, st, what);
    default:
      return absl::OkStatus();
  }
}

Status CopyDir(int src, int dst, const std::string& rel, int depth, CopyContext& ctx) {
  // Read the whole listing first and close the stream: only two fds stay open per level.
  std::vector<std::string> names;
  {
    UniqueFd fd(::openat(src, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd.valid()) {
      return ErrnoError("open", "/" + rel);
    }
    DIR* d = ::fdopendir(fd.get());
    if (d == nullptr) {
      return ErrnoError("fdopendir", "/" + rel);
    }
    (void)fd.Release();  // the stream owns it now; closedir closes it
    errno = 0;
    while (struct dirent* e = ::readdir(d)) {
      std::string_view n = e->d_name;
      if (n != "." && n != "..") {
        names.emplace_back(n);
      }
      errno = 0;
    }
    int err = errno;
    ::closedir(d);
    if (err != 0) {
      return ErrnoError("readdir", "/" + rel, err);
    }
  }
  for (const std::string& name : names) {
    BRAGG_RETURN_IF_ERROR(CopyEntry(src, dst, rel, name, depth, ctx));
  }
  return absl::OkStatus();
}

}  // namespace

Status CopyLayerTree(int src_dir, const std::string& dst) {
  struct stat st;
  if (::fstat(src_dir, &st) != 0) {
    return ErrnoError("fstat", "the writable layer");
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError("CopyLayerTree: the source is not a directory");
  }
  if (::mkdir(dst.c_str(), 0700) != 0) {
    return ErrnoError("mkdir", dst);
  }
  Status status = [&]() -> Status {
    BRAGG_ASSIGN_OR_RETURN(UniqueFd root,
                           OpenFile(dst, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    // An O_PATH fd cannot be read; reopen the source for reading.
    int s = ::openat(src_dir, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (s < 0) {
      return ErrnoError("open", "the writable layer");
    }
    UniqueFd src(s);
    CopyContext ctx;
    ctx.dst_root = root.get();
    BRAGG_RETURN_IF_ERROR(CopyDir(src.get(), root.get(), "", 0, ctx));
    BRAGG_RETURN_IF_ERROR(CopyMetadata(src.get(), root.get(), st, "/"));
    spdlog::debug("frozen layer {}: {} entries, {} bytes", dst, ctx.files, ctx.bytes);
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    if (Status rm = RemoveTree(dst); !rm.ok()) {
      spdlog::warn("removing the partial frozen layer {}: {}", dst, std::string(rm.message()));
    }
    return Annotate(status, "copying the writable layer");
  }
  return absl::OkStatus();
}

Result<std::shared_ptr<const FrozenLayer>> FrozenLayer::Create(
    const std::string& layers_dir, const std::string& name, int src_dir,
    std::shared_ptr<const FrozenLayer> below) {
  size_t depth = below ? below->depth() + 1 : 1;
  if (depth > kMaxFrozenDepth) {
    return absl::FailedPreconditionError(fmt::format(
        "clones may be nested {} deep at most; clone an earlier generation", kMaxFrozenDepth));
  }
  BRAGG_RETURN_IF_ERROR(MakeDirs(layers_dir, 0700));
  std::string path = layers_dir + "/" + name;
  BRAGG_RETURN_IF_ERROR(CopyLayerTree(src_dir, path));
  return std::shared_ptr<const FrozenLayer>(new FrozenLayer(path, std::move(below), depth));
}

FrozenLayer::~FrozenLayer() {
  if (Status s = RemoveTree(path_); !s.ok()) {
    spdlog::warn("removing frozen layer {}: {}", path_, std::string(s.message()));
  } else {
    spdlog::debug("frozen layer {} removed", path_);
  }
}

std::vector<std::string> FrozenLayer::LowerDirs() const {
  std::vector<std::string> out;
  for (const FrozenLayer* l = this; l != nullptr; l = l->below_.get()) {
    out.push_back(l->path_);
  }
  return out;
}

}  // namespace bragg::pbox
