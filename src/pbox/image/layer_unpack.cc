#include "pbox/image/layer_unpack.h"

#include <archive_entry.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <string_view>
#include <vector>

#include "common/fs.h"
#include "fmt/format.h"

namespace bragg::pbox {
namespace {

// Opening a directory below the layer root: never through a symlink, never into another
// mount, never above the root.
constexpr uint64_t kBeneathNoLinks =
    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
constexpr std::string_view kWhiteoutPrefix = ".wh.";
constexpr std::string_view kOpaqueMarker = ".wh..wh..opq";
constexpr size_t kMaxDisplay = 200;

std::string Display(std::string_view path) {
  std::string out;
  for (char c : path.substr(0, kMaxDisplay)) {
    out += (static_cast<unsigned char>(c) < 0x20) ? '?' : c;
  }
  if (path.size() > kMaxDisplay) {
    out += fmt::format("... ({} bytes)", path.size());
  }
  return out;
}

Status Bad(std::string_view entry, std::string_view why) {
  return absl::InvalidArgumentError(
      fmt::format("hostile or malformed archive entry \"{}\": {}", Display(entry), why));
}

Status EntryErrno(std::string_view call, std::string_view entry, int err = errno) {
  return ErrnoError(call, fmt::format("archive entry \"{}\"", Display(entry)), err);
}

// "./a//b/" -> {"a", "b"}. Absolute paths and ".." components are refused; "" or "." is the
// root (no components).
Result<std::vector<std::string>> SplitEntryPath(std::string_view raw, std::string_view what) {
  if (!raw.empty() && raw[0] == '/') {
    return Bad(raw, fmt::format("{} is an absolute path", what));
  }
  std::vector<std::string> parts;
  size_t i = 0;
  while (i <= raw.size()) {
    size_t j = raw.find('/', i);
    if (j == std::string_view::npos) {
      j = raw.size();
    }
    std::string_view part = raw.substr(i, j - i);
    if (part == "..") {
      return Bad(raw, fmt::format("{} has a \"..\" component", what));
    }
    if (part.size() > NAME_MAX) {
      return Bad(raw, fmt::format("{} has a component longer than {} bytes", what, NAME_MAX));
    }
    if (!part.empty() && part != ".") {
      parts.emplace_back(part);
    }
    i = j + 1;
  }
  return parts;
}

// A relative symlink target, resolved lexically from the link's directory (depth `depth`
// below the root), must stay inside the layer. Absolute targets resolve in the sandbox's root
// and are fine.
bool RelativeTargetEscapes(std::string_view target, size_t depth) {
  if (target.empty() || target[0] == '/') {
    return false;
  }
  int64_t level = static_cast<int64_t>(depth);
  size_t i = 0;
  while (i <= target.size()) {
    size_t j = target.find('/', i);
    if (j == std::string_view::npos) {
      j = target.size();
    }
    std::string_view part = target.substr(i, j - i);
    if (part == "..") {
      if (--level < 0) {
        return true;
      }
    } else if (!part.empty() && part != ".") {
      ++level;
    }
    i = j + 1;
  }
  return false;
}

Result<UniqueFd> OpenBeneath(int dirfd, const std::string& path, std::string_view entry) {
  struct open_how how = {};
  how.flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
  how.resolve = kBeneathNoLinks;
  for (int attempt = 0;; ++attempt) {
    long fd = ::syscall(SYS_openat2, dirfd, path.c_str(), &how, sizeof(how));
    if (fd >= 0) {
      return UniqueFd(static_cast<int>(fd));
    }
    if (errno == EAGAIN && attempt < 16) {
      continue;
    }
    if (errno == ELOOP) {
      return Bad(entry, fmt::format("\"{}\" is or goes through a symlink: refusing to write "
                                    "through it",
                                    Display(path)));
    }
    if (errno == ENOTDIR) {
      return Bad(entry, fmt::format("\"{}\" is not a directory", Display(path)));
    }
    if (errno == EXDEV) {
      return Bad(entry, fmt::format("\"{}\" leaves the layer", Display(path)));
    }
    return EntryErrno("openat2", entry);
  }
}

class Unpacker {
 public:
  Unpacker(int root, const UnpackLimits& limits) : root_(root), limits_(limits) {}

  Status Entry(struct archive* a, struct archive_entry* e);
  const LayerStats& stats() const { return stats_; }

 private:
  // The directory holding parts[0..n-1], created (0755, root-owned) where missing if `create`.
  Result<UniqueFd> OpenParent(const std::vector<std::string>& parts, size_t n, bool create,
                              std::string_view entry);
  // Makes room for a new entry `name` in `dir`: removes what is there, except a directory
  // when `keep_dir` (a directory entry over an existing directory updates it in place).
  // Returns whether a directory was kept.
  Result<bool> Clear(int dir, const std::string& name, bool keep_dir, std::string_view entry);
  Status WriteData(struct archive* a, int fd, uint64_t size, std::string_view entry);
  Status SetXattrs(struct archive_entry* e, int fd, std::string_view entry);

  const int root_;
  const UnpackLimits limits_;
  LayerStats stats_;
};

Result<UniqueFd> Unpacker::OpenParent(const std::vector<std::string>& parts, size_t n, bool create,
                                      std::string_view entry) {
  if (n == 0) {
    int fd = ::fcntl(root_, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      return ErrnoError("fcntl", "F_DUPFD_CLOEXEC");
    }
    return UniqueFd(fd);
  }
  std::string path;
  for (size_t i = 0; i < n; ++i) {
    path += (i == 0 ? "" : "/") + parts[i];
  }
  auto whole = OpenBeneath(root_, path, entry);
  if (whole.ok() || !create || whole.status().code() != absl::StatusCode::kNotFound) {
    return whole;
  }
  // Some parent is missing: walk down, creating what is not there.
  BRAGG_ASSIGN_OR_RETURN(UniqueFd cur, OpenParent(parts, 0, false, entry));
  for (size_t i = 0; i < n; ++i) {
    if (::mkdirat(cur.get(), parts[i].c_str(), 0755) != 0 && errno != EEXIST) {
      return EntryErrno("mkdirat", entry);
    }
    BRAGG_ASSIGN_OR_RETURN(UniqueFd next, OpenBeneath(cur.get(), parts[i], entry));
    cur = std::move(next);
  }
  return cur;
}

Result<bool> Unpacker::Clear(int dir, const std::string& name, bool keep_dir,
                             std::string_view entry) {
  struct stat st;
  if (::fstatat(dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) {
      return false;
    }
    return EntryErrno("fstatat", entry);
  }
  if (S_ISDIR(st.st_mode)) {
    if (keep_dir) {
      return true;
    }
    if (::unlinkat(dir, name.c_str(), AT_REMOVEDIR) != 0) {
      if (errno == ENOTEMPTY || errno == EEXIST) {
        return Bad(entry, "replaces a non-empty directory of the same layer");
      }
      return EntryErrno("unlinkat", entry);
    }
    return false;
  }
  if (::unlinkat(dir, name.c_str(), 0) != 0) {
    return EntryErrno("unlinkat", entry);
  }
  return false;
}

Status Unpacker::WriteData(struct archive* a, int fd, uint64_t size, std::string_view entry) {
  const void* buf = nullptr;
  size_t len = 0;
  la_int64_t offset = 0;
  for (;;) {
    int r = archive_read_data_block(a, &buf, &len, &offset);
    if (r == ARCHIVE_EOF) {
      break;
    }
    if (r != ARCHIVE_OK) {
      return Bad(entry, fmt::format("reading its data: {}", ArchiveErrorString(a)));
    }
    if (offset < 0 || static_cast<uint64_t>(offset) + len > size) {
      return Bad(entry, "data beyond the size in its header");
    }
    const char* p = static_cast<const char*>(buf);
    while (len > 0) {
      ssize_t n = ::pwrite(fd, p, len, offset);
      if (n < 0) {
        if (errno == EINTR) {
          continue;
        }
        return EntryErrno("pwrite", entry);
      }
      p += n;
      len -= static_cast<size_t>(n);
      offset += n;
    }
  }
  // Sparse files end in a hole that no data block covers.
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    return EntryErrno("ftruncate", entry);
  }
  return absl::OkStatus();
}

Status Unpacker::SetXattrs(struct archive_entry* e, int fd, std::string_view entry) {
  if (archive_entry_xattr_reset(e) == 0) {
    return absl::OkStatus();
  }
  const char* name = nullptr;
  const void* value = nullptr;
  size_t size = 0;
  while (archive_entry_xattr_next(e, &name, &value, &size) == ARCHIVE_OK) {
    std::string_view n(name);
    // trusted.overlay.* (forged whiteouts, redirects) and security.selinux never come from
    // an archive.
    // user.overlay.* is what an overlay mounted with `userxattr` (rootless) reads as its own.
    if ((n.substr(0, 5) != "user." && n != "security.capability") ||
        n.substr(0, 13) == "user.overlay." || (limits_.rootless && n == "security.capability")) {
      continue;
    }
    if (::fsetxattr(fd, name, value, size, 0) != 0) {
      return EntryErrno(fmt::format("fsetxattr {}", n), entry);
    }
  }
  return absl::OkStatus();
}

Status Unpacker::Entry(struct archive* a, struct archive_entry* e) {
  const char* raw_c = archive_entry_pathname(e);
  if (raw_c == nullptr) {
    return Bad("", "an entry without a path");
  }
  std::string raw = raw_c;
  if (++stats_.entries > limits_.max_entries) {
    return absl::ResourceExhaustedError(
        fmt::format("the layer has more than {} entries", limits_.max_entries));
  }
  BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> parts, SplitEntryPath(raw, "its path"));
  if (parts.empty()) {
    return absl::OkStatus();  // "./": the layer root itself
  }
  const std::string& name = parts.back();
  const size_t depth = parts.size() - 1;
  mode_t type = archive_entry_filetype(e);
  const char* hardlink = archive_entry_hardlink(e);

  if (std::string_view(name).substr(0, kWhiteoutPrefix.size()) == kWhiteoutPrefix) {
    BRAGG_ASSIGN_OR_RETURN(UniqueFd dir, OpenParent(parts, depth, true, raw));
    if (name == kOpaqueMarker) {
      const char* opaque = limits_.rootless ? "user.overlay.opaque" : "trusted.overlay.opaque";
      if (::fsetxattr(dir.get(), opaque, "y", 1, 0) != 0) {
        return EntryErrno(fmt::format("fsetxattr {}", opaque), raw);
      }
      return absl::OkStatus();
    }
    std::string hidden = name.substr(kWhiteoutPrefix.size());
    if (hidden.empty() || hidden == "." || hidden == "..") {
      return Bad(raw, "a whiteout that names no entry");
    }
    BRAGG_ASSIGN_OR_RETURN(bool kept, Clear(dir.get(), hidden, false, raw));
    (void)kept;
    if (::mknodat(dir.get(), hidden.c_str(), S_IFCHR | 0, makedev(0, 0)) == 0) {
      return absl::OkStatus();
    }
    if (!limits_.rootless || errno != EPERM) {
      return EntryErrno("mknodat (whiteout)", raw);
    }
    // Before Linux 5.8 a user may not make the overlay's whiteout device. There a rootless
    // agent mounts roots with fuse-overlayfs, which also takes an empty file .wh.NAME beside
    // NAME for a whiteout: the archive's own entry, kept as it came.
    UniqueFd marker(
        ::openat(dir.get(), name.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0));
    if (!marker.valid()) {
      return EntryErrno("openat (whiteout file)", raw);
    }
    return absl::OkStatus();
  }

  // Rootless: chown to oneself, which cannot fail for want of privilege.
  const uid_t uid = limits_.rootless ? ::geteuid() : static_cast<uid_t>(archive_entry_uid(e));
  const gid_t gid = limits_.rootless ? ::getegid() : static_cast<gid_t>(archive_entry_gid(e));
  const mode_t perm = archive_entry_perm(e) & 07777;
  BRAGG_ASSIGN_OR_RETURN(UniqueFd dir, OpenParent(parts, depth, true, raw));

  if (hardlink != nullptr) {
    BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> target,
                           SplitEntryPath(hardlink, "its hard link target"));
    if (target.empty()) {
      return Bad(raw, "a hard link to the layer root");
    }
    auto target_dir = OpenParent(target, target.size() - 1, false, raw);
    if (!target_dir.ok()) {
      if (target_dir.status().code() == absl::StatusCode::kNotFound) {
        return Bad(raw, fmt::format("hard link target \"{}\" is not an earlier entry of the layer",
                                    Display(hardlink)));
      }
      return target_dir.status();
    }
    struct stat st;
    if (::fstatat(target_dir->get(), target.back().c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      return Bad(raw, fmt::format("hard link target \"{}\" is not an earlier entry of the layer",
                                  Display(hardlink)));
    }
    if (!S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
      return Bad(raw, "a hard link to something that is not a regular file or symlink");
    }
    BRAGG_RETURN_IF_ERROR(Clear(dir.get(), name, false, raw).status());
    if (::linkat(target_dir->get(), target.back().c_str(), dir.get(), name.c_str(), 0) != 0) {
      return EntryErrno("linkat", raw);
    }
    return absl::OkStatus();
  }

  switch (type) {
    case AE_IFDIR: {
      BRAGG_ASSIGN_OR_RETURN(bool kept, Clear(dir.get(), name, true, raw));
      if (!kept && ::mkdirat(dir.get(), name.c_str(), 0700) != 0) {
        return EntryErrno("mkdirat", raw);
      }
      BRAGG_ASSIGN_OR_RETURN(UniqueFd d, OpenBeneath(dir.get(), name, raw));
      if (::fchown(d.get(), uid, gid) != 0 || ::fchmod(d.get(), perm) != 0) {
        return EntryErrno("fchown/fchmod", raw);
      }
      return SetXattrs(e, d.get(), raw);
    }
    case AE_IFREG: {
      if (!archive_entry_size_is_set(e) || archive_entry_size(e) < 0) {
        return Bad(raw, "a regular file without a size");
      }
      uint64_t size = static_cast<uint64_t>(archive_entry_size(e));
      if (size > limits_.max_bytes || stats_.bytes + size > limits_.max_bytes) {
        return absl::ResourceExhaustedError(fmt::format(
            "archive entry \"{}\" ({} bytes) takes the image past its limit of {} bytes "
            "(pboxd --max-image-bytes)",
            Display(raw), size, limits_.max_bytes));
      }
      stats_.bytes += size;
      BRAGG_RETURN_IF_ERROR(Clear(dir.get(), name, false, raw).status());
      int fd = ::openat(dir.get(), name.c_str(),
                        O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd < 0) {
        return EntryErrno("openat", raw);
      }
      UniqueFd file(fd);
      BRAGG_RETURN_IF_ERROR(WriteData(a, file.get(), size, raw));
      // chown before chmod: chown clears set-user-ID bits.
      if (::fchown(file.get(), uid, gid) != 0 || ::fchmod(file.get(), perm) != 0) {
        return EntryErrno("fchown/fchmod", raw);
      }
      BRAGG_RETURN_IF_ERROR(SetXattrs(e, file.get(), raw));
      struct timespec ts[2];
      ts[0].tv_sec = ts[1].tv_sec = archive_entry_mtime(e);
      ts[0].tv_nsec = ts[1].tv_nsec = archive_entry_mtime_nsec(e);
      if (::futimens(file.get(), ts) != 0) {
        return EntryErrno("futimens", raw);
      }
      return absl::OkStatus();
    }
    case AE_IFLNK: {
      const char* target = archive_entry_symlink(e);
      if (target == nullptr || *target == '\0') {
        return Bad(raw, "a symlink without a target");
      }
      if (RelativeTargetEscapes(target, depth)) {
        return Bad(raw,
                   fmt::format("symlink target \"{}\" points out of the layer", Display(target)));
      }
      BRAGG_RETURN_IF_ERROR(Clear(dir.get(), name, false, raw).status());
      if (::symlinkat(target, dir.get(), name.c_str()) != 0) {
        return EntryErrno("symlinkat", raw);
      }
      if (::fchownat(dir.get(), name.c_str(), uid, gid, AT_SYMLINK_NOFOLLOW) != 0) {
        return EntryErrno("fchownat", raw);
      }
      return absl::OkStatus();
    }
    case AE_IFIFO: {
      BRAGG_RETURN_IF_ERROR(Clear(dir.get(), name, false, raw).status());
      if (::mknodat(dir.get(), name.c_str(), S_IFIFO | perm, 0) != 0) {
        return EntryErrno("mknodat (fifo)", raw);
      }
      if (::fchownat(dir.get(), name.c_str(), uid, gid, AT_SYMLINK_NOFOLLOW) != 0) {
        return EntryErrno("fchownat", raw);
      }
      return absl::OkStatus();
    }
    case AE_IFCHR:
    case AE_IFBLK:
      return Bad(raw,
                 "device nodes are refused (a sandbox gets its own /dev; build the image "
                 "without /dev entries, e.g. mmdebstrap --skip=output/dev)");
    case AE_IFSOCK:
      return Bad(raw, "sockets are refused");
    default:
      return Bad(raw, fmt::format("unknown entry type {:o}", type));
  }
}

}  // namespace

void ArchiveFree::operator()(struct archive* a) const {
  if (a != nullptr) {
    archive_read_free(a);
  }
}

std::string ArchiveErrorString(struct archive* a) {
  const char* message = a == nullptr ? nullptr : archive_error_string(a);
  return message == nullptr ? "unknown error" : message;
}

Result<ArchivePtr> OpenTarArchive(const std::string& path) {
  ArchivePtr a(archive_read_new());
  if (!a) {
    return absl::ResourceExhaustedError("archive_read_new: out of memory");
  }
  archive_read_support_filter_all(a.get());
  archive_read_support_format_tar(a.get());
  archive_read_support_format_gnutar(a.get());
  if (archive_read_open_filename(a.get(), path.c_str(), 1 << 20) != ARCHIVE_OK) {
    return absl::InvalidArgumentError(fmt::format("{}: not a tar archive (plain, gzip or zstd): {}",
                                                  path, ArchiveErrorString(a.get())));
  }
  return a;
}

Result<LayerStats> UnpackLayer(const std::string& archive_path, const std::string& dest,
                               const UnpackLimits& limits) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd root, OpenFile(dest, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
  BRAGG_ASSIGN_OR_RETURN(ArchivePtr a, OpenTarArchive(archive_path));
  Unpacker unpacker(root.get(), limits);
  for (;;) {
    struct archive_entry* e = nullptr;
    int r = archive_read_next_header(a.get(), &e);
    if (r == ARCHIVE_EOF) {
      break;
    }
    if (r == ARCHIVE_WARN) {
      // e.g. an unknown pax keyword: the entry itself is usable.
    } else if (r != ARCHIVE_OK) {
      return absl::InvalidArgumentError(fmt::format("malformed archive after {} entries: {}",
                                                    unpacker.stats().entries,
                                                    ArchiveErrorString(a.get())));
    }
    BRAGG_RETURN_IF_ERROR(unpacker.Entry(a.get(), e));
  }
  return unpacker.stats();
}

}  // namespace bragg::pbox
