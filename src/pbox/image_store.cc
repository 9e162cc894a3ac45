#include "pbox/image_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <regex>

#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"

namespace bragg::pbox {
namespace {

constexpr const char* kPasswd =
    "root:x:0:0:root:/root:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
constexpr const char* kGroup = "root:x:0:\nnogroup:x:65534:\n";
constexpr const char* kHosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n";
constexpr const char* kNsswitch = "passwd: files\ngroup: files\nshadow: files\nhosts: files\n";

// Host /etc entries copied into the skeleton: what dynamic linking, Python and common tools
// read. Nothing with secrets (shadow, ssh keys, machine-id) is copied.
constexpr const char* kEtcCopies[] = {
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "python3",
    "python3.11",
    "localtime",
    "os-release",
    "debian_version",
    "ssl",
    "ca-certificates.conf",
    "profile",
    "bash.bashrc",
    "inputrc",
    "mime.types",
    "protocols",
    "services",
    "matplotlibrc",
    "gitconfig",
    "magic",
    "magic.mime",
};

Status Symlink(const std::string& target, const std::string& path) {
  if (::symlink(target.c_str(), path.c_str()) != 0) {
    return ErrnoError("symlink", path);
  }
  return absl::OkStatus();
}

Status MakeDir(const std::string& path, mode_t mode) {
  if (::mkdir(path.c_str(), mode) != 0 && errno != EEXIST) {
    return ErrnoError("mkdir", path);
  }
  // mkdir applies the umask; the sticky /tmp needs its exact mode.
  if (::chmod(path.c_str(), mode) != 0) {
    return ErrnoError("chmod", path);
  }
  return absl::OkStatus();
}

Status BuildHostSkeleton(const std::string& dir, const std::string& host_root) {
  for (const char* d : {"", "/usr", "/proc", "/dev", "/etc", "/home", "/opt", "/mnt", "/run",
                        "/srv", "/var", "/var/lib", "/var/cache", "/workspace"}) {
    BRAGG_RETURN_IF_ERROR(MakeDir(dir + d, 0755));
  }
  BRAGG_RETURN_IF_ERROR(MakeDir(dir + "/root", 0700));
  BRAGG_RETURN_IF_ERROR(MakeDir(dir + "/tmp", 01777));
  BRAGG_RETURN_IF_ERROR(MakeDir(dir + "/var/tmp", 01777));
  // Merged /usr: the top-level program and library directories are links into /usr.
  for (const char* link : {"bin", "sbin", "lib", "lib32", "lib64", "libx32"}) {
    struct stat st;
    std::string host = fmt::format("{}/{}", host_root == "/" ? "" : host_root, link);
    std::string in_usr = fmt::format("{}/usr/{}", host_root == "/" ? "" : host_root, link);
    if (::lstat(in_usr.c_str(), &st) == 0) {
      BRAGG_RETURN_IF_ERROR(Symlink(fmt::format("usr/{}", link), fmt::format("{}/{}", dir, link)));
    } else if (::lstat(host.c_str(), &st) == 0) {
      return absl::FailedPreconditionError(fmt::format(
          "host {} is not under /usr: the \"host\" image needs a merged-/usr system", host));
    }
  }
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(dir + "/etc/passwd", kPasswd));
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(dir + "/etc/group", kGroup));
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(dir + "/etc/hosts", kHosts));
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(dir + "/etc/hostname", "pbox\n"));
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(dir + "/etc/nsswitch.conf", kNsswitch));
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(dir + "/etc/resolv.conf", ""));
  std::vector<std::string> cp = {"cp", "-a", "--no-preserve=ownership"};
  bool any = false;
  for (const char* name : kEtcCopies) {
    std::string src = fmt::format("{}/etc/{}", host_root == "/" ? "" : host_root, name);
    struct stat st;
    if (::lstat(src.c_str(), &st) == 0) {
      cp.push_back(src);
      any = true;
    }
  }
  if (any) {
    cp.push_back(dir + "/etc/");
    BRAGG_ASSIGN_OR_RETURN(ChildProcess child, Spawn(cp));
    BRAGG_ASSIGN_OR_RETURN(ExitInfo exit, child.Wait());
    if (exit.signal != 0 || exit.exit_code != 0) {
      return absl::InternalError(
          fmt::format("copying host /etc files into the host image: cp {}", DescribeExit(exit)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

Result<std::pair<std::string, std::string>> ParseImageFlag(const std::string& flag) {
  static const std::regex kName("[a-z0-9][a-z0-9._-]{0,63}");
  size_t eq = flag.find('=');
  if (eq == std::string::npos) {
    return absl::InvalidArgumentError(
        fmt::format("--image {}: expected NAME=DIR, e.g. --image debian=/srv/images/debian", flag));
  }
  std::string name = flag.substr(0, eq);
  std::string dir = flag.substr(eq + 1);
  if (!std::regex_match(name, kName)) {
    return absl::InvalidArgumentError(
        fmt::format("--image {}: image names are lower-case letters, digits, '.', '_', '-'", flag));
  }
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(fmt::format("--image {}: DIR must be absolute", flag));
  }
  return std::make_pair(name, dir);
}

Result<ImageStore> ImageStore::Create(const std::string& images_dir,
                                      const std::map<std::string, std::string>& named,
                                      const std::string& host_root) {
  ImageStore store;
  BRAGG_RETURN_IF_ERROR(MakeDirs(images_dir, 0755));
  std::string host_dir = images_dir + "/host";
  std::string staging = images_dir + "/.host-new";
  BRAGG_RETURN_IF_ERROR(RemoveTree(staging));
  BRAGG_RETURN_IF_ERROR(Annotate(BuildHostSkeleton(staging, host_root), "building image host"));
  BRAGG_RETURN_IF_ERROR(RemoveTree(host_dir));
  if (::rename(staging.c_str(), host_dir.c_str()) != 0) {
    return ErrnoError("rename", host_dir);
  }
  store.images_["host"] = Image{
      .name = "host",
      .lower_dirs = {host_dir},
      .binds = {{host_root == "/" ? "/usr" : host_root + "/usr", "/usr"}},
  };
  for (const auto& [name, dir] : named) {
    if (name == "host") {
      return absl::InvalidArgumentError("--image host=...: \"host\" is built in");
    }
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(fmt::format("image {}: {} is not a directory", name, dir));
    }
    store.images_[name] = Image{.name = name, .lower_dirs = {dir}, .binds = {}};
  }
  return store;
}

Result<const Image*> ImageStore::Get(const std::string& name) const {
  auto it = images_.find(name.empty() ? "host" : name);
  if (it == images_.end()) {
    std::string known;
    for (const auto& [n, _] : images_) {
      known += (known.empty() ? "" : ", ") + n;
    }
    return absl::NotFoundError(fmt::format("unknown image \"{}\" (known: {})", name, known));
  }
  return &it->second;
}

std::vector<std::string> ImageStore::Names() const {
  std::vector<std::string> out;
  for (const auto& [n, _] : images_) {
    out.push_back(n);
  }
  return out;
}

}  // namespace bragg::pbox
