#include "pbox/image/image_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <regex>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"
#include "pbox/image/image_archive.h"
#include "pbox/image/layer_unpack.h"
#include "spdlog/spdlog.h"

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
    // Not all of ssl/: ssl/private holds the host's private keys.
    "ssl/certs",
    "ssl/openssl.cnf",
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
  // One cp per directory of the image's /etc that receives copies ("" and "ssl").
  std::map<std::string, std::vector<std::string>> copies;
  for (std::string_view name : kEtcCopies) {
    std::string src = fmt::format("{}/etc/{}", host_root == "/" ? "" : host_root, name);
    struct stat st;
    if (::lstat(src.c_str(), &st) == 0) {
      size_t slash = name.rfind('/');
      copies[std::string(slash == std::string_view::npos ? "" : name.substr(0, slash))].push_back(
          src);
    }
  }
  for (auto& [sub, sources] : copies) {
    const std::string into = sub.empty() ? dir + "/etc/" : fmt::format("{}/etc/{}/", dir, sub);
    if (!sub.empty()) {
      BRAGG_RETURN_IF_ERROR(MakeDir(into, 0755));
    }
    std::vector<std::string> cp = {"cp", "-a", "--no-preserve=ownership"};
    cp.insert(cp.end(), sources.begin(), sources.end());
    cp.push_back(into);
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

Result<std::unique_ptr<ImageStore>> ImageStore::Create(
    const std::string& images_dir, const std::map<std::string, std::string>& named,
    const std::string& host_root, ImageStoreOptions options) {
  std::unique_ptr<ImageStore> store(new ImageStore());
  store->options_ = options;
  BRAGG_RETURN_IF_ERROR(MakeDirs(images_dir, 0755));
  std::string host_dir = images_dir + "/host";
  std::string staging = images_dir + "/.host-new";
  BRAGG_RETURN_IF_ERROR(RemoveTree(staging));
  BRAGG_RETURN_IF_ERROR(Annotate(BuildHostSkeleton(staging, host_root), "building image host"));
  BRAGG_RETURN_IF_ERROR(RemoveTree(host_dir));
  if (::rename(staging.c_str(), host_dir.c_str()) != 0) {
    return ErrnoError("rename", host_dir);
  }
  store->images_["host"] = Image{
      .name = "host",
      .lower_dirs = {host_dir},
      .binds = {{host_root == "/" ? "/usr" : host_root + "/usr", "/usr"}},
  };
  store->fixed_.insert("host");
  for (const auto& [name, dir] : named) {
    if (name == "host") {
      return absl::InvalidArgumentError("--image host=...: \"host\" is built in");
    }
    struct stat st;
    if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(fmt::format("image {}: {} is not a directory", name, dir));
    }
    store->images_[name] = Image{.name = name, .lower_dirs = {dir}, .binds = {}};
    store->fixed_.insert(name);
  }
  store->store_dir_ = images_dir + "/store";
  store->layers_dir_ = store->store_dir_ + "/layers";
  store->manifests_dir_ = store->store_dir_ + "/manifests";
  store->scratch_dir_ = store->store_dir_ + "/tmp";
  store->mountpoints_dir_ = store->store_dir_ + "/mountpoints";
  BRAGG_RETURN_IF_ERROR(Annotate(store->LoadImported(), "loading imported images"));
  return store;
}

namespace {

constexpr const char* kTmpPrefix = ".tmp-";
// OverlayFS takes its options in one page; the native runtime adds upper, work and its own
// paths to the lower dirs.
constexpr size_t kMaxLowerDirChars = 3000;

bool ValidImageName(const std::string& name) {
  static const std::regex kName("[a-z0-9][a-z0-9._-]{0,63}");
  return std::regex_match(name, kName);
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

Result<std::vector<std::string>> ListDirNames(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return ErrnoError("opendir", dir);
  }
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") {
      out.push_back(n);
    }
  }
  ::closedir(d);
  return out;
}

// Writes `data` to `path` through a temporary file and rename, so a reader (or an agent
// restarted after a crash) sees the old content or the new one, never a torn one.
Status WriteFileAtomically(const std::string& path, const std::string& data) {
  std::string tmp = path + ".tmp";
  {
    BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644));
    BRAGG_RETURN_IF_ERROR(WriteAll(fd.get(), data));
    if (::fsync(fd.get()) != 0) {
      return ErrnoError("fsync", tmp);
    }
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    Status s = ErrnoError("rename", path);
    ::unlink(tmp.c_str());
    return s;
  }
  return absl::OkStatus();
}

}  // namespace

std::string ImageStore::LayerRoot(const std::string& sha) const {
  return fmt::format("{}/{}/root", layers_dir_, sha);
}

Image ImageStore::ImportedImage(const std::string& name, const Imported& meta) const {
  // Top first; the mount points the runtime needs (/dev, /proc) sit above every image, so an
  // image without them still starts. Empty directories merge with the image's own.
  Image image{.name = name, .lower_dirs = {mountpoints_dir_}, .binds = {}};
  for (auto it = meta.layers.rbegin(); it != meta.layers.rend(); ++it) {
    image.lower_dirs.push_back(LayerRoot(*it));
  }
  return image;
}

Status ImageStore::LoadImported() {
  for (const std::string& d : {store_dir_, layers_dir_, manifests_dir_}) {
    BRAGG_RETURN_IF_ERROR(MakeDirs(d, 0755));
  }
  // Uploads and unpacks of an agent that died mid-import.
  BRAGG_RETURN_IF_ERROR(RemoveTree(scratch_dir_));
  BRAGG_RETURN_IF_ERROR(MakeDirs(scratch_dir_, 0700));
  BRAGG_RETURN_IF_ERROR(RemoveTree(mountpoints_dir_));
  for (const char* d : {"", "/dev", "/proc"}) {
    BRAGG_RETURN_IF_ERROR(MakeDirs(mountpoints_dir_ + d, 0755));
  }
  BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> layers, ListDirNames(layers_dir_));
  for (const std::string& sha : layers) {
    if (sha.rfind(kTmpPrefix, 0) == 0) {
      BRAGG_RETURN_IF_ERROR(RemoveTree(layers_dir_ + "/" + sha));
      continue;
    }
    auto meta = ReadFileToString(fmt::format("{}/{}/layer.json", layers_dir_, sha));
    nlohmann::json j = meta.ok() ? nlohmann::json::parse(*meta, nullptr, false) : nlohmann::json();
    layer_bytes_[sha] = j.is_object() && j.contains("bytes") && j["bytes"].is_number_unsigned()
                            ? j["bytes"].get<uint64_t>()
                            : 0;
  }
  BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> manifests, ListDirNames(manifests_dir_));
  for (const std::string& file : manifests) {
    std::string path = manifests_dir_ + "/" + file;
    if (file.size() < 6 || file.substr(file.size() - 5) != ".json") {
      (void)::unlink(path.c_str());  // a ".tmp" of a write that did not finish
      continue;
    }
    std::string name = file.substr(0, file.size() - 5);
    BRAGG_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
    nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    Imported meta;
    bool ok = j.is_object() && j.contains("layers") && j["layers"].is_array();
    if (ok) {
      for (const auto& l : j["layers"]) {
        if (!l.is_string() || layer_bytes_.count(l.get<std::string>()) == 0) {
          ok = false;
          break;
        }
        meta.layers.push_back(l.get<std::string>());
        meta.bytes += layer_bytes_[meta.layers.back()];
      }
      meta.format = j.value("format", "rootfs");
      meta.created_unix_ms = j.value("created_unix_ms", int64_t{0});
    }
    if (!ok || !ValidImageName(name)) {
      spdlog::warn("image store: {} is damaged or names a missing layer; ignoring it", path);
      continue;
    }
    if (fixed_.count(name) != 0) {
      spdlog::warn("image store: imported image {} is shadowed by --image {}", name, name);
      continue;
    }
    images_[name] = ImportedImage(name, meta);
    imported_[name] = std::move(meta);
  }
  if (!imported_.empty()) {
    spdlog::info("image store: {} imported images, {} layers", imported_.size(),
                 layer_bytes_.size());
  }
  return absl::OkStatus();
}

Result<Image> ImageStore::Get(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = images_.find(name.empty() ? "host" : name);
  if (it == images_.end()) {
    std::string known;
    for (const auto& [n, _] : images_) {
      known += (known.empty() ? "" : ", ") + n;
    }
    return absl::NotFoundError(fmt::format("unknown image \"{}\" (known: {})", name, known));
  }
  return it->second;
}

Result<ImageLease> ImageStore::Acquire(const std::string& name) {
  BRAGG_ASSIGN_OR_RETURN(Image image, Get(name));
  std::lock_guard<std::mutex> lock(mu_);
  // Get's lock was dropped: the image may have been removed or replaced since.
  auto it = images_.find(image.name);
  if (it == images_.end()) {
    return absl::NotFoundError(fmt::format("image \"{}\" was removed just now", name));
  }
  ImageLease lease;
  lease.store_ = this;
  lease.image_ = it->second;
  if (auto imp = imported_.find(image.name); imp != imported_.end()) {
    lease.layers_ = imp->second.layers;
  }
  ++uses_[image.name];
  PinLocked(lease.layers_);
  return lease;
}

void ImageStore::PinLocked(const std::vector<std::string>& layers) {
  for (const std::string& sha : layers) {
    ++layer_pins_[sha];
  }
}

void ImageStore::UnpinLocked(const std::vector<std::string>& layers) {
  for (const std::string& sha : layers) {
    if (--layer_pins_[sha] == 0) {
      layer_pins_.erase(sha);
    }
  }
}

void ImageStore::Release(const std::string& name, const std::vector<std::string>& layers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (--uses_[name] == 0) {
    uses_.erase(name);
  }
  UnpinLocked(layers);
}

std::vector<std::string> ImageStore::Names() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [n, _] : images_) {
    out.push_back(n);
  }
  return out;
}

std::vector<ImageInfo> ImageStore::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ImageInfo> out;
  for (const auto& [n, image] : images_) {
    ImageInfo info;
    info.name = n;
    auto uses = uses_.find(n);
    info.sandboxes = uses == uses_.end() ? 0 : uses->second;
    if (auto imp = imported_.find(n); imp != imported_.end()) {
      info.kind = "imported";
      info.format = imp->second.format;
      info.layers = imp->second.layers;
      info.bytes = imp->second.bytes;
      info.created_unix_ms = imp->second.created_unix_ms;
    } else {
      info.kind = n == "host" ? "host" : "directory";
    }
    out.push_back(std::move(info));
  }
  return out;
}

Result<std::pair<std::string, uint64_t>> ImageStore::AddLayer(const std::string& tarball,
                                                              const std::string& sha) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = layer_bytes_.find(sha); it != layer_bytes_.end()) {
      return std::make_pair(sha, it->second);
    }
  }
  BRAGG_ASSIGN_OR_RETURN(TempDir tmp, TempDir::Create(layers_dir_, kTmpPrefix));
  std::string root = tmp.path() + "/root";
  BRAGG_RETURN_IF_ERROR(MakeDirs(root, 0755));
  UnpackLimits limits;
  limits.max_bytes = options_.max_image_bytes;
  limits.rootless = options_.rootless;
  BRAGG_ASSIGN_OR_RETURN(LayerStats stats, UnpackLayer(tarball, root, limits));
  BRAGG_RETURN_IF_ERROR(WriteStringToFile(
      tmp.path() + "/layer.json",
      nlohmann::json{{"bytes", stats.bytes}, {"entries", stats.entries}}.dump() + "\n"));
  std::string final_dir = fmt::format("{}/{}", layers_dir_, sha);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = layer_bytes_.find(sha); it != layer_bytes_.end()) {
    return std::make_pair(sha, it->second);  // a concurrent import of the same layer won
  }
  if (::rename(tmp.path().c_str(), final_dir.c_str()) != 0) {
    return ErrnoError("rename", final_dir);
  }
  (void)tmp.Release();  // renamed into place: no longer the TempDir's to remove
  layer_bytes_[sha] = stats.bytes;
  return std::make_pair(sha, stats.bytes);
}

Result<ImageInfo> ImageStore::Import(const std::string& name, const std::string& archive_path,
                                     const std::string& ref) {
  if (!ValidImageName(name)) {
    return absl::InvalidArgumentError(
        fmt::format("image name \"{}\": use 1-64 lower-case letters, digits, '.', '_', '-'", name));
  }
  if (fixed_.count(name) != 0) {
    return absl::AlreadyExistsError(
        fmt::format("image \"{}\" is {}: pick another name", name,
                    name == "host" ? "built in" : "a directory image given to pboxd with --image"));
  }
  auto t0 = std::chrono::steady_clock::now();
  BRAGG_ASSIGN_OR_RETURN(TempDir scratch, TempDir::Create(scratch_dir_, "import-"));
  BRAGG_ASSIGN_OR_RETURN(ImageLayers split, SplitImageArchive(archive_path, scratch.path(),
                                                              options_.max_image_bytes, ref));
  std::vector<std::string> shas;
  for (const std::string& layer : split.layers) {
    BRAGG_ASSIGN_OR_RETURN(std::string sha, Sha256File(layer));
    shas.push_back(sha);
  }
  // Pin the layers for the length of the import, so a concurrent Prune keeps them.
  {
    std::lock_guard<std::mutex> lock(mu_);
    PinLocked(shas);
  }
  absl::Cleanup unpin = [this, &shas] {
    std::lock_guard<std::mutex> lock(mu_);
    UnpinLocked(shas);
  };
  Imported meta;
  meta.format = split.format;
  meta.created_unix_ms = NowUnixMs();
  for (size_t i = 0; i < split.layers.size(); ++i) {
    auto added = AddLayer(split.layers[i], shas[i]);
    if (!added.ok()) {
      return split.format == "rootfs"
                 ? added.status()
                 : Annotate(added.status(), fmt::format("layer {} of {} (sha256 {})", i + 1,
                                                        split.layers.size(), shas[i]));
    }
    meta.layers.push_back(shas[i]);
    meta.bytes += added->second;
  }
  Image image = ImportedImage(name, meta);
  size_t lower_chars = 0;
  for (const std::string& d : image.lower_dirs) {
    lower_chars += d.size() + 1;
  }
  if (lower_chars > kMaxLowerDirChars) {
    return absl::InvalidArgumentError(fmt::format(
        "image has {} layers: their paths ({} bytes) do not fit in one OverlayFS mount; squash "
        "the image (e.g. export a container's root filesystem) and import that",
        meta.layers.size(), lower_chars));
  }
  nlohmann::json manifest = {{"name", name},
                             {"format", meta.format},
                             {"layers", meta.layers},
                             {"created_unix_ms", meta.created_unix_ms}};
  std::lock_guard<std::mutex> lock(mu_);
  BRAGG_RETURN_IF_ERROR(WriteFileAtomically(fmt::format("{}/{}.json", manifests_dir_, name),
                                            manifest.dump(2) + "\n"));
  images_[name] = std::move(image);
  imported_[name] = meta;
  spdlog::info("image {} imported ({}, {} layers, {} bytes) in {:.1f} s", name, meta.format,
               meta.layers.size(), meta.bytes,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  ImageInfo info{.name = name,
                 .kind = "imported",
                 .format = meta.format,
                 .layers = meta.layers,
                 .bytes = meta.bytes,
                 .created_unix_ms = meta.created_unix_ms,
                 .sandboxes = 0};
  auto uses = uses_.find(name);
  info.sandboxes = uses == uses_.end() ? 0 : uses->second;
  return info;
}

Status ImageStore::Remove(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fixed_.count(name) != 0) {
    return absl::FailedPreconditionError(
        fmt::format("image \"{}\" is {}: only imported images can be removed", name,
                    name == "host" ? "built in" : "a directory image given to pboxd with --image"));
  }
  if (imported_.count(name) == 0) {
    return absl::NotFoundError(fmt::format("no imported image \"{}\"", name));
  }
  if (auto uses = uses_.find(name); uses != uses_.end() && uses->second > 0) {
    return absl::FailedPreconditionError(fmt::format(
        "image \"{}\" is in use by {} live sandbox{}: destroy {} first", name, uses->second,
        uses->second == 1 ? "" : "es", uses->second == 1 ? "it" : "them"));
  }
  std::string path = fmt::format("{}/{}.json", manifests_dir_, name);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoError("unlink", path);
  }
  images_.erase(name);
  imported_.erase(name);
  spdlog::info("image {} removed", name);
  return absl::OkStatus();
}

Result<ImageStore::PruneResult> ImageStore::Prune() {
  std::lock_guard<std::mutex> lock(mu_);
  std::set<std::string> referenced;
  for (const auto& [_, meta] : imported_) {
    referenced.insert(meta.layers.begin(), meta.layers.end());
  }
  PruneResult result;
  for (auto it = layer_bytes_.begin(); it != layer_bytes_.end();) {
    const std::string& sha = it->first;
    if (referenced.count(sha) != 0 || layer_pins_.count(sha) != 0) {
      ++it;
      continue;
    }
    // Out of the content-addressed name first, so that a crash mid-removal leaves a ".tmp-"
    // directory (dropped at the next start), never a half-empty layer under its sha.
    std::string dir = fmt::format("{}/{}", layers_dir_, sha);
    std::string doomed = fmt::format("{}/{}prune-{}", layers_dir_, kTmpPrefix, sha);
    if (::rename(dir.c_str(), doomed.c_str()) != 0) {
      return ErrnoError("rename", dir);
    }
    BRAGG_RETURN_IF_ERROR(RemoveTree(doomed));
    result.layers.push_back(sha);
    result.bytes += it->second;
    it = layer_bytes_.erase(it);
  }
  spdlog::info("image prune: {} layers removed, {} bytes", result.layers.size(), result.bytes);
  return result;
}

ImageLease::~ImageLease() { Release(); }

ImageLease::ImageLease(ImageLease&& other) noexcept
    : store_(std::exchange(other.store_, nullptr)),
      image_(std::move(other.image_)),
      layers_(std::move(other.layers_)) {}

ImageLease& ImageLease::operator=(ImageLease&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = std::exchange(other.store_, nullptr);
    image_ = std::move(other.image_);
    layers_ = std::move(other.layers_);
  }
  return *this;
}

void ImageLease::Release() {
  if (store_ != nullptr) {
    std::exchange(store_, nullptr)->Release(image_.name, layers_);
  }
}

}  // namespace bragg::pbox
