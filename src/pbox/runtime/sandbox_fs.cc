#include "pbox/runtime/sandbox_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/magic.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <utility>

#include "fmt/format.h"

namespace bragg::pbox {
namespace {

// Resolution of every user path: ".." and absolute symlinks stop at the root fd, and
// /proc-style magic links (which jump anywhere) are refused with ELOOP.
constexpr uint64_t kInRoot = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS;
// Opening one entry of a directory during a recursive remove: the entry itself, never a
// symlink, never another mount.
constexpr uint64_t kExactEntry =
    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;

// openat2 returns EAGAIN when a concurrent rename anywhere on the system makes a ".." step
// unverifiable (openat2(2)); retrying is the documented answer. Also bounds retries of
// check-then-act loops that untrusted code can keep racing.
constexpr int kMaxRetries = 64;
// Recursive remove holds one fd per level; deeper trees are refused rather than exhausting fds.
constexpr int kMaxRemoveDepth = 256;
// How much of a hostile path goes into an error message.
constexpr size_t kMaxDisplay = 256;

// The user's path, made printable: NUL bytes shown as "\0", long paths cut.
std::string Display(std::string_view path) {
  std::string out;
  for (char c : path.substr(0, kMaxDisplay)) {
    if (c == '\0') {
      out += "\\0";
    } else {
      out += c;
    }
  }
  if (path.size() > kMaxDisplay) {
    out += fmt::format("... ({} bytes)", path.size());
  }
  return out;
}

// A validated user path split into components, with empty and "." components dropped.
struct ParsedPath {
  std::vector<std::string> components;
  std::string display;

  bool is_root() const { return components.empty(); }
  const std::string& last() const { return components.back(); }
  // The first `n` components joined with "/" ("." when n is 0), relative to the root fd.
  std::string Join(size_t n) const {
    if (n == 0) {
      return ".";
    }
    std::string out = components[0];
    for (size_t i = 1; i < n; ++i) {
      out += '/';
      out += components[i];
    }
    return out;
  }
  std::string JoinAll() const { return Join(components.size()); }
  std::string Parent() const { return Join(components.size() - 1); }
};

Result<ParsedPath> ParsePath(std::string_view path) {
  ParsedPath parsed;
  parsed.display = Display(path);
  if (path.find('\0') != std::string_view::npos) {
    return absl::InvalidArgumentError(
        fmt::format("invalid path \"{}\": it contains a NUL byte", parsed.display));
  }
  if (path.size() >= PATH_MAX) {
    return absl::InvalidArgumentError(
        fmt::format("invalid path \"{}\": {} bytes is longer than PATH_MAX ({})", parsed.display,
                    path.size(), PATH_MAX));
  }
  std::string_view last_raw;
  size_t pos = 0;
  while (pos < path.size()) {
    size_t end = path.find('/', pos);
    if (end == std::string_view::npos) {
      end = path.size();
    }
    std::string_view component = path.substr(pos, end - pos);
    pos = end + 1;
    if (component.empty()) {
      continue;
    }
    last_raw = component;
    if (component != ".") {
      parsed.components.emplace_back(component);
    }
  }
  if (last_raw == "." || last_raw == "..") {
    return absl::InvalidArgumentError(
        fmt::format("invalid path \"{}\": the last component must name an entry, not \"{}\"",
                    parsed.display, std::string(last_raw)));
  }
  return parsed;
}

// openat2 with retries on EAGAIN/EINTR; -1 with errno set on failure.
int RawOpenat2(int dirfd, const std::string& path, uint64_t flags, uint64_t mode,
               uint64_t resolve) {
  struct open_how how = {};
  how.flags = flags | O_CLOEXEC;
  how.mode = (flags & O_CREAT) != 0 ? mode : 0;
  how.resolve = resolve;
  for (int attempt = 0;; ++attempt) {
    long fd = ::syscall(SYS_openat2, dirfd, path.c_str(), &how, sizeof(how));
    if (fd >= 0) {
      return static_cast<int>(fd);
    }
    if ((errno != EAGAIN && errno != EINTR) || attempt >= kMaxRetries) {
      return -1;
    }
  }
}

Result<UniqueFd> OpenInRoot(int root_fd, const std::string& path, uint64_t flags,
                            std::string_view call, const std::string& display, uint64_t mode = 0) {
  int fd = RawOpenat2(root_fd, path, flags, mode, kInRoot);
  if (fd < 0) {
    return ErrnoError(call, display);
  }
  return UniqueFd(fd);
}

// The directory holding the last component of `p` (the root itself for "a").
Result<UniqueFd> ResolveParent(int root_fd, const ParsedPath& p) {
  return OpenInRoot(root_fd, p.Parent(), O_PATH | O_DIRECTORY, "resolve", p.display);
}

FileKind KindOf(mode_t mode) {
  if (S_ISREG(mode)) {
    return FileKind::kRegular;
  }
  if (S_ISDIR(mode)) {
    return FileKind::kDirectory;
  }
  if (S_ISLNK(mode)) {
    return FileKind::kSymlink;
  }
  return FileKind::kOther;
}

const char* TypeName(mode_t mode) {
  if (S_ISDIR(mode)) {
    return "a directory";
  }
  if (S_ISFIFO(mode)) {
    return "a FIFO";
  }
  if (S_ISSOCK(mode)) {
    return "a socket";
  }
  if (S_ISCHR(mode) || S_ISBLK(mode)) {
    return "a device";
  }
  if (S_ISLNK(mode)) {
    return "a symlink";
  }
  return "not a regular file";
}

FileStat ToFileStat(std::string name, const struct stat& st) {
  FileStat out;
  out.name = std::move(name);
  out.kind = KindOf(st.st_mode);
  out.size = static_cast<uint64_t>(st.st_size);
  out.mode = st.st_mode & 07777;
  out.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  return out;
}

Result<std::string> ReadLinkAt(int dirfd, const std::string& name, const std::string& display) {
  std::string buf(PATH_MAX, '\0');
  ssize_t n = ::readlinkat(dirfd, name.c_str(), buf.data(), buf.size());
  if (n < 0) {
    return ErrnoError("readlink", display);
  }
  buf.resize(static_cast<size_t>(n));
  return buf;
}

// Refuses anything but a regular file, then makes the fd blocking again (it was opened
// O_NONBLOCK so that a FIFO could not block the open).
Result<UniqueFd> RequireRegular(UniqueFd fd, const std::string& display) {
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) {
    return ErrnoError("fstat", display);
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: is {}; only regular files can be read or written", display, TypeName(st.st_mode)));
  }
  int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    return ErrnoError("fcntl(F_SETFL)", display);
  }
  return fd;
}

// open(2) says ENXIO for a UNIX socket, for O_WRONLY|O_NONBLOCK on a FIFO with no reader and
// for a device with nothing behind it: never a regular file.
Status NotRegularAfterEnxio(const std::string& display) {
  return absl::InvalidArgumentError(fmt::format(
      "{}: is a socket, FIFO or device; only regular files can be read or written", display));
}

// Makes sure the first `count` components of `p` are directories, creating missing ones 0755
// one at a time with mkdirat relative to the previous component's fd. Returns the fd of the
// last one (the root for count == 0).
Result<UniqueFd> MakeParents(int root_fd, const ParsedPath& p, size_t count) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd cur,
                         OpenInRoot(root_fd, ".", O_PATH | O_DIRECTORY, "resolve", p.display));
  for (size_t i = 0; i < count; ++i) {
    const std::string& name = p.components[i];
    const std::string prefix = p.Join(i + 1);
    for (int attempt = 0;; ++attempt) {
      int fd = RawOpenat2(root_fd, prefix, O_PATH | O_DIRECTORY, 0, kInRoot);
      if (fd >= 0) {
        cur.Reset(fd);
        break;
      }
      if (errno != ENOENT) {
        return ErrnoError("resolve", fmt::format("{} (parent {})", p.display, prefix));
      }
      if (attempt >= kMaxRetries) {
        // mkdirat keeps saying EEXIST while resolution says ENOENT: a dangling symlink, or
        // something inside the sandbox racing us.
        return absl::FailedPreconditionError(
            fmt::format("{}: cannot create parent directory {}: it exists but does not "
                        "resolve to a directory (a dangling symlink?)",
                        p.display, prefix));
      }
      if (::mkdirat(cur.get(), name.c_str(), 0755) != 0 && errno != EEXIST) {
        return ErrnoError("mkdir", fmt::format("{} (parent {})", p.display, prefix));
      }
    }
  }
  return cur;
}

Result<std::vector<std::string>> ReadNames(DIR* dir, const std::string& display) {
  std::vector<std::string> names;
  for (;;) {
    errno = 0;
    struct dirent* entry = ::readdir(dir);
    if (entry == nullptr) {
      if (errno != 0) {
        return ErrnoError("readdir", display);
      }
      break;
    }
    std::string_view name = entry->d_name;
    if (name != "." && name != "..") {
      names.emplace_back(name);
    }
  }
  return names;
}

// Removes `name` in `parent_fd` and, if it is a directory, everything below it. Never follows
// a symlink and never enters another mount. A missing entry is OK unless `must_exist`.
Status RemoveTreeAt(int parent_fd, const std::string& name, const std::string& display, int depth,
                    bool must_exist) {
  for (int attempt = 0; attempt < kMaxRetries; ++attempt) {
    if (::unlinkat(parent_fd, name.c_str(), 0) == 0) {
      return absl::OkStatus();
    }
    if (errno == ENOENT && !must_exist) {
      return absl::OkStatus();
    }
    if (errno != EISDIR) {
      return ErrnoError("unlink", display);
    }
    int raw = RawOpenat2(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW, 0, kExactEntry);
    if (raw < 0) {
      if (errno == EXDEV) {
        return absl::FailedPreconditionError(fmt::format(
            "refusing to remove {}: it is a mount point (not removing across mounts)", display));
      }
      if (errno == ELOOP || errno == ENOTDIR || errno == ENOENT) {
        continue;  // Swapped or removed since unlinkat: look again.
      }
      return ErrnoError("open directory", display);
    }
    UniqueFd fd(raw);
    if (depth >= kMaxRemoveDepth) {
      return absl::FailedPreconditionError(fmt::format(
          "refusing to remove {}: the tree is deeper than {} levels", display, kMaxRemoveDepth));
    }
    UniqueDir dir(::fdopendir(fd.get()));
    if (dir == nullptr) {
      return ErrnoError("fdopendir", display);
    }
    (void)fd.Release();  // Owned by `dir` now.
    BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> names, ReadNames(dir.get(), display));
    for (const std::string& child : names) {
      BRAGG_RETURN_IF_ERROR(
          RemoveTreeAt(::dirfd(dir.get()), child, display + "/" + child, depth + 1, false));
    }
    if (::unlinkat(parent_fd, name.c_str(), AT_REMOVEDIR) == 0) {
      return absl::OkStatus();
    }
    if (errno == ENOENT) {
      return absl::OkStatus();
    }
    if (errno != ENOTEMPTY && errno != ENOTDIR) {
      return ErrnoError("rmdir", display);
    }
    // Something inside the sandbox added entries or swapped the directory: go round again.
  }
  return absl::AbortedError(
      fmt::format("removing {}: it kept changing while being removed; retry", display));
}

}  // namespace

Result<SandboxFs> SandboxFs::Open(const std::string& root) {
  int fd = ::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return ErrnoError("open sandbox root", root);
  }
  UniqueFd root_fd(fd);
  int probe = RawOpenat2(root_fd.get(), ".", O_PATH | O_DIRECTORY, 0, kInRoot);
  if (probe < 0) {
    if (errno == ENOSYS) {
      return absl::UnimplementedError(
          "openat2(2) is not available: confined sandbox file operations need Linux 5.6 or "
          "newer");
    }
    return ErrnoError("openat2", root);
  }
  UniqueFd probe_fd(probe);  // Closed here: only checked that openat2 works.
  return SandboxFs(std::move(root_fd));
}

Result<FileStat> SandboxFs::Stat(std::string_view path) const {
  BRAGG_ASSIGN_OR_RETURN(ParsedPath p, ParsePath(path));
  struct stat st;
  if (p.is_root()) {
    if (::fstat(root_.get(), &st) != 0) {
      return ErrnoError("stat", p.display);
    }
    return ToFileStat(std::string(path), st);
  }
  BRAGG_ASSIGN_OR_RETURN(UniqueFd parent, ResolveParent(root_.get(), p));
  if (::fstatat(parent.get(), p.last().c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return ErrnoError("lstat", p.display);
  }
  FileStat out = ToFileStat(std::string(path), st);
  if (S_ISLNK(st.st_mode)) {
    BRAGG_ASSIGN_OR_RETURN(out.symlink_target, ReadLinkAt(parent.get(), p.last(), p.display));
  }
  return out;
}

Result<UniqueFd> SandboxFs::OpenRead(std::string_view path) const {
  BRAGG_ASSIGN_OR_RETURN(ParsedPath p, ParsePath(path));
  if (p.is_root()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: is the root directory; only regular files can be read", p.display));
  }
  int fd = RawOpenat2(root_.get(), p.JoinAll(), O_RDONLY | O_NONBLOCK | O_NOCTTY, 0, kInRoot);
  if (fd < 0) {
    if (errno == ENXIO) {
      return NotRegularAfterEnxio(p.display);
    }
    return ErrnoError("open", p.display);
  }
  return RequireRegular(UniqueFd(fd), p.display);
}

Result<UniqueFd> SandboxFs::OpenWrite(std::string_view path, uint32_t mode, bool make_parents,
                                      bool append) const {
  BRAGG_ASSIGN_OR_RETURN(ParsedPath p, ParsePath(path));
  if (p.is_root()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: is the root directory; only regular files can be written", p.display));
  }
  if (make_parents) {
    BRAGG_RETURN_IF_ERROR(MakeParents(root_.get(), p, p.components.size() - 1).status());
  }
  uint64_t flags = O_WRONLY | O_CREAT | O_NONBLOCK | O_NOCTTY | (append ? O_APPEND : O_TRUNC);
  int fd = RawOpenat2(root_.get(), p.JoinAll(), flags, mode & 07777, kInRoot);
  if (fd < 0) {
    const int err = errno;
    if (err == ENXIO) {
      return NotRegularAfterEnxio(p.display);
    }
    // A new file in a pseudo-filesystem is refused like an existing one (the caller checks
    // the file it opened), and as CreatePending refuses it.
    if (auto dir = ResolveParent(root_.get(), p); dir.ok()) {
      BRAGG_RETURN_IF_ERROR(RefusePseudoFs(dir->get(), p.display));
    }
    return ErrnoError("open for writing", p.display, err);
  }
  return RequireRegular(UniqueFd(fd), p.display);
}

Result<std::vector<FileStat>> SandboxFs::ListDir(std::string_view path) const {
  BRAGG_ASSIGN_OR_RETURN(ParsedPath p, ParsePath(path));
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenInRoot(root_.get(), p.JoinAll(), O_RDONLY | O_DIRECTORY,
                                                 "opendir", p.display));
  UniqueDir dir(::fdopendir(fd.get()));
  if (dir == nullptr) {
    return ErrnoError("fdopendir", p.display);
  }
  (void)fd.Release();  // Owned by `dir` now.
  BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> names, ReadNames(dir.get(), p.display));
  std::sort(names.begin(), names.end());
  std::vector<FileStat> out;
  out.reserve(names.size());
  int dfd = ::dirfd(dir.get());
  for (std::string& name : names) {
    struct stat st;
    if (::fstatat(dfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) {
        continue;  // Removed since readdir.
      }
      FileStat unknown;
      unknown.name = std::move(name);
      out.push_back(std::move(unknown));
      continue;
    }
    FileStat entry = ToFileStat(name, st);
    if (S_ISLNK(st.st_mode)) {
      // A symlink replaced since fstatat keeps an empty target rather than failing the listing.
      Result<std::string> target = ReadLinkAt(dfd, name, p.display);
      if (target.ok()) {
        entry.symlink_target = *std::move(target);
      }
    }
    out.push_back(std::move(entry));
  }
  return out;
}

Status SandboxFs::MakeDir(std::string_view path, uint32_t mode, bool parents) const {
  BRAGG_ASSIGN_OR_RETURN(ParsedPath p, ParsePath(path));
  if (p.is_root()) {
    if (parents) {
      return absl::OkStatus();
    }
    return absl::AlreadyExistsError(fmt::format("mkdir({}): the root directory exists", p.display));
  }
  UniqueFd parent;
  if (parents) {
    BRAGG_ASSIGN_OR_RETURN(parent, MakeParents(root_.get(), p, p.components.size() - 1));
  } else {
    BRAGG_ASSIGN_OR_RETURN(parent, ResolveParent(root_.get(), p));
  }
  if (::mkdirat(parent.get(), p.last().c_str(), mode & 07777) == 0) {
    return absl::OkStatus();
  }
  int err = errno;
  if (err == EEXIST && parents) {
    // mkdir -p: an existing directory (or a symlink to one inside the root) is fine.
    int fd = RawOpenat2(root_.get(), p.JoinAll(), O_PATH | O_DIRECTORY, 0, kInRoot);
    UniqueFd existing(fd);
    if (existing.valid()) {
      return absl::OkStatus();
    }
    return absl::AlreadyExistsError(
        fmt::format("mkdir({}): exists and is not a directory", p.display));
  }
  return ErrnoError("mkdir", p.display, err);
}

Status SandboxFs::Remove(std::string_view path, bool recursive) const {
  BRAGG_ASSIGN_OR_RETURN(ParsedPath p, ParsePath(path));
  if (p.is_root()) {
    return absl::InvalidArgumentError(
        fmt::format("refusing to remove \"{}\": it is the sandbox root", p.display));
  }
  BRAGG_ASSIGN_OR_RETURN(UniqueFd parent, ResolveParent(root_.get(), p));
  if (recursive) {
    return RemoveTreeAt(parent.get(), p.last(), p.display, 0, true);
  }
  if (::unlinkat(parent.get(), p.last().c_str(), 0) == 0) {
    return absl::OkStatus();
  }
  if (errno != EISDIR) {
    return ErrnoError("unlink", p.display);
  }
  if (::unlinkat(parent.get(), p.last().c_str(), AT_REMOVEDIR) != 0) {
    return ErrnoError("rmdir", p.display);
  }
  return absl::OkStatus();
}

Status SandboxFs::Move(std::string_view src, std::string_view dst, bool no_replace) const {
  BRAGG_ASSIGN_OR_RETURN(ParsedPath s, ParsePath(src));
  BRAGG_ASSIGN_OR_RETURN(ParsedPath d, ParsePath(dst));
  if (s.is_root() || d.is_root()) {
    return absl::InvalidArgumentError(fmt::format(
        "refusing to move \"{}\" to \"{}\": the sandbox root cannot be moved or replaced",
        s.display, d.display));
  }
  const std::string what = fmt::format("{} -> {}", s.display, d.display);
  Result<UniqueFd> src_parent = ResolveParent(root_.get(), s);
  if (!src_parent.ok()) {
    return Annotate(src_parent.status(), fmt::format("rename {}", what));
  }
  Result<UniqueFd> dst_parent = ResolveParent(root_.get(), d);
  if (!dst_parent.ok()) {
    return Annotate(dst_parent.status(), fmt::format("rename {}", what));
  }
  if (::renameat2(src_parent->get(), s.last().c_str(), dst_parent->get(), d.last().c_str(),
                  no_replace ? RENAME_NOREPLACE : 0) != 0) {
    return ErrnoError("rename", what);
  }
  return absl::OkStatus();
}

}  // namespace bragg::pbox

namespace bragg::pbox {

PendingFile::PendingFile(PendingFile&& other) noexcept
    : dir_(std::move(other.dir_)),
      fd_(std::move(other.fd_)),
      temp_(std::exchange(other.temp_, std::string())),
      name_(std::move(other.name_)),
      display_(std::move(other.display_)),
      keep_mode_(other.keep_mode_) {}

PendingFile& PendingFile::operator=(PendingFile&& other) noexcept {
  if (this != &other) {
    Discard();
    dir_ = std::move(other.dir_);
    fd_ = std::move(other.fd_);
    temp_ = std::exchange(other.temp_, std::string());
    name_ = std::move(other.name_);
    display_ = std::move(other.display_);
    keep_mode_ = other.keep_mode_;
  }
  return *this;
}

PendingFile::~PendingFile() { Discard(); }

void PendingFile::Discard() {
  fd_.Reset();
  if (!temp_.empty() && dir_.valid()) {
    // Best effort: the name is ours (created O_EXCL), so nothing else is removed with it.
    (void)::unlinkat(dir_.get(), temp_.c_str(), 0);
  }
  temp_.clear();
}

Status PendingFile::Commit(uint32_t mode) {
  if (temp_.empty()) {
    return absl::FailedPreconditionError(
        fmt::format("{}: the upload was already committed or discarded", display_));
  }
  if (::fchmod(fd_.get(), keep_mode_.value_or(mode) & 07777) != 0) {
    return ErrnoError("fchmod", display_);
  }
  if (::renameat(dir_.get(), temp_.c_str(), dir_.get(), name_.c_str()) != 0) {
    if (errno == EISDIR) {
      return absl::InvalidArgumentError(
          fmt::format("{}: is a directory; only regular files can be written", display_));
    }
    return ErrnoError("rename", display_);
  }
  temp_.clear();
  return absl::OkStatus();
}

Result<PendingFile> SandboxFs::CreatePending(std::string_view path, bool make_parents) const {
  BRAGG_ASSIGN_OR_RETURN(ParsedPath p, ParsePath(path));
  const std::string display = p.display;
  if (p.is_root()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: is the root directory; only regular files can be written", display));
  }
  UniqueFd dir;
  if (make_parents) {
    BRAGG_ASSIGN_OR_RETURN(dir, MakeParents(root_.get(), p, p.components.size() - 1));
  } else {
    BRAGG_ASSIGN_OR_RETURN(dir, ResolveParent(root_.get(), p));
  }
  // As WriteFile's open() does, a symlink in the last place is followed (inside the root, hop
  // by hop, at most 40 as the kernel allows): the upload replaces what the link names, a
  // dangling link included, and the link stays.
  struct stat st;
  bool exists = false;
  for (int hops = 0;; ++hops) {
    exists = ::fstatat(dir.get(), p.last().c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0;
    if (!exists || !S_ISLNK(st.st_mode)) {
      break;
    }
    if (hops >= 40) {
      return ErrnoError("resolve", display, ELOOP);
    }
    char target[PATH_MAX];
    ssize_t n = ::readlinkat(dir.get(), p.last().c_str(), target, sizeof(target) - 1);
    if (n < 0) {
      return ErrnoError("readlink", display);
    }
    std::string next(target, static_cast<size_t>(n));
    if (next.empty() || next[0] != '/') {
      next = "/" + p.Parent() + "/" + next;
    }
    BRAGG_ASSIGN_OR_RETURN(p, ParsePath(next));
    if (p.is_root()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: is the root directory; only regular files can be written", display));
    }
    BRAGG_ASSIGN_OR_RETURN(dir, ResolveParent(root_.get(), p));
  }
  if (exists && S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        fmt::format("{}: is a directory; only regular files can be written", display));
  }
  // As OpenWrite refuses them: the rename would otherwise replace a device, FIFO or socket
  // (the sandbox's /dev/null) with a regular file.
  if (exists && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: is {}; only regular files can be read or written", display, TypeName(st.st_mode)));
  }
  // Where WriteFile refuses the opened file, refuse its directory (the temporary file could
  // not be made there anyway, but the answer must be the same on both paths).
  BRAGG_RETURN_IF_ERROR(RefusePseudoFs(dir.get(), display));
  // A file that exists keeps its permission bits, as when WriteFile truncates it.
  std::optional<uint32_t> keep_mode;
  if (exists && S_ISREG(st.st_mode)) {
    keep_mode = st.st_mode & 07777;
  }
  for (int attempt = 0;; ++attempt) {
    uint64_t random = 0;
    if (::getrandom(&random, sizeof(random), 0) != sizeof(random)) {
      return ErrnoError("getrandom", p.display);
    }
    std::string temp = fmt::format(".pbox-upload-{:016x}", random);
    // A single component in a directory fd we hold, created O_EXCL without following
    // symlinks: whatever the sandbox puts there, this is a new regular file of ours.
    int fd = ::openat(dir.get(), temp.c_str(),
                      O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, 0600);
    if (fd >= 0) {
      PendingFile pending(std::move(dir), UniqueFd(fd), std::move(temp), p.last(), display);
      pending.keep_mode_ = keep_mode;
      return pending;
    }
    if (errno != EEXIST || attempt >= kMaxRetries) {
      return ErrnoError("create", fmt::format("{} (temporary file {})", display, temp));
    }
  }
}

Status RefusePseudoFs(int fd, std::string_view path) {
  struct statfs sfs;
  if (::fstatfs(fd, &sfs) != 0) {
    return ErrnoError("fstatfs", std::string(path));
  }
  switch (static_cast<unsigned long>(sfs.f_type)) {
    case PROC_SUPER_MAGIC:
    case SYSFS_MAGIC:
    case CGROUP_SUPER_MAGIC:
    case CGROUP2_SUPER_MAGIC:
    case DEBUGFS_MAGIC:
    case SECURITYFS_MAGIC:
    case BPF_FS_MAGIC:
      return absl::PermissionDeniedError(
          fmt::format("{}: file transfer into kernel pseudo-filesystems is not allowed", path));
    default:
      return absl::OkStatus();
  }
}

}  // namespace bragg::pbox
