#pragma once

// Images a sandbox's root filesystem is built from. An image is a read-only lower layer for
// OverlayFS plus read-only bind mounts of host directories placed into the sandbox root.
//
// "host" (always present): a small skeleton (minimal /etc, /tmp, /proc, /dev mount points, the
// merged-/usr symlinks bin -> usr/bin ...) with the host's /usr bound read-only, so the
// host's programs (python3 with numpy) work without building an image. No host home, root or
// work directory is visible.
// Named directory images (`--image NAME=DIR`): DIR is the lower layer as is.
// Imported images (`pbox image import`): content-addressed layers, see ImageStore.

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::pbox {

struct BindMount {
  std::string source;  // host path
  std::string target;  // path inside the sandbox root, e.g. "/usr"
};

struct Image {
  std::string name;
  std::vector<std::string> lower_dirs;  // OverlayFS lower layers, top first
  std::vector<BindMount> binds;         // read-only, applied after the overlay
};

struct ImageStoreOptions {
  // Largest import: the uploaded archive, and separately the sum of its unpacked files.
  uint64_t max_image_bytes = 4ull << 30;
  // The agent runs without root: imported layers are unpacked as UnpackLimits::rootless.
  bool rootless = false;
};

// What `pbox image ls` shows of one image.
struct ImageInfo {
  std::string name;
  std::string kind;                 // "host", "directory" (--image NAME=DIR) or "imported"
  std::string format;               // imported: "rootfs", "docker-archive" or "oci-archive"
  std::vector<std::string> layers;  // imported: sha256 of each layer tarball, bottom first
  uint64_t bytes = 0;               // imported: sum of the layers' file sizes
  int64_t created_unix_ms = 0;      // imported: when
  uint32_t sandboxes = 0;           // live sandboxes holding it
};

class ImageStore;

// A sandbox's hold on its image: while it lives, the image cannot be removed and its layers
// are not pruned. Move-only; the store must outlive it.
class ImageLease {
 public:
  ImageLease() = default;
  ~ImageLease();
  ImageLease(ImageLease&& other) noexcept;
  ImageLease& operator=(ImageLease&& other) noexcept;
  ImageLease(const ImageLease&) = delete;
  ImageLease& operator=(const ImageLease&) = delete;

  const Image& image() const { return image_; }

 private:
  friend class ImageStore;
  void Release();
  ImageStore* store_ = nullptr;
  Image image_;
  std::vector<std::string> layers_;
};

// The agent's images: the built-in "host", the --image directories, and images imported from
// tarballs. Imported images persist under `images_dir`/store: each layer is unpacked once per
// node into layers/<sha256 of the layer tarball>/root (read-only from then on, shared by every
// image and sandbox that uses it as an OverlayFS lower layer), and each image is a JSON
// manifest (manifests/NAME.json, written by rename) listing its layers. Thread-safe.
class ImageStore {
 public:
  // Builds the "host" skeleton under `images_dir`/host (replacing an older one), checks each
  // named image's directory exists, and loads the imported images (dropping unfinished
  // imports of a previous agent). `host_root` is "/" except in tests.
  static Result<std::unique_ptr<ImageStore>> Create(const std::string& images_dir,
                                                    const std::map<std::string, std::string>& named,
                                                    const std::string& host_root = "/",
                                                    ImageStoreOptions options = {});

  // NotFound with the list of known images if `name` is unknown. "" means "host".
  Result<Image> Get(const std::string& name) const;
  // Get, and hold the image for a sandbox until the lease is destroyed.
  Result<ImageLease> Acquire(const std::string& name);
  std::vector<std::string> Names() const;
  std::vector<ImageInfo> List() const;

  // Imports the archive at `archive_path` (a rootfs tarball, plain/gzip/zstd, a docker/
  // podman save archive or an OCI image layout in a tar; `ref` picks one image of an archive
  // holding several, see SplitImageArchive) as `name`, replacing an imported image of that name
  // (sandboxes running on the old one keep it). Layers already on this node are reused. On any
  // error nothing new is left in the store. InvalidArgument for a bad name or a hostile or
  // malformed archive (naming the entry), ResourceExhausted past max_image_bytes,
  // AlreadyExists for the name of a built-in or directory image.
  Result<ImageInfo> Import(const std::string& name, const std::string& archive_path,
                           const std::string& ref = "");
  // Forgets an imported image (its layers stay until Prune). NotFound if unknown,
  // FailedPrecondition if a sandbox uses it or it is not an imported image.
  Status Remove(const std::string& name);
  struct PruneResult {
    std::vector<std::string> layers;  // removed, by sha256
    uint64_t bytes = 0;
  };
  // Removes the layers no image, no sandbox and no import in progress refers to.
  Result<PruneResult> Prune();

  // Where uploads are spooled before Import (emptied when the store is created).
  const std::string& scratch_dir() const { return scratch_dir_; }
  uint64_t max_image_bytes() const { return options_.max_image_bytes; }

 private:
  friend class ImageLease;
  struct Imported {
    std::string format;
    std::vector<std::string> layers;  // bottom first
    uint64_t bytes = 0;
    int64_t created_unix_ms = 0;
  };
  ImageStore() = default;
  Status LoadImported();
  Image ImportedImage(const std::string& name, const Imported& meta) const;
  // Unpacks one layer tarball unless the store has it; returns its sha256 and size. The
  // caller has put the sha256 in pending_ before (so Prune keeps it).
  Result<std::pair<std::string, uint64_t>> AddLayer(const std::string& tarball,
                                                    const std::string& sha);
  void Release(const std::string& name, const std::vector<std::string>& layers);
  void PinLocked(const std::vector<std::string>& layers);
  void UnpinLocked(const std::vector<std::string>& layers);
  std::string LayerRoot(const std::string& sha) const;

  std::string store_dir_, layers_dir_, manifests_dir_, scratch_dir_, mountpoints_dir_;
  ImageStoreOptions options_;
  std::set<std::string> fixed_;  // "host" and --image names

  mutable std::mutex mu_;
  std::map<std::string, Image> images_;
  std::map<std::string, Imported> imported_;
  std::map<std::string, uint64_t> layer_bytes_;  // sha -> size of its files
  std::map<std::string, uint32_t> uses_;         // image name -> live leases
  std::map<std::string, uint32_t> layer_pins_;   // sha -> live leases + imports in progress
};

// Parses "NAME=DIR" (NAME: [a-z0-9][a-z0-9._-]*, DIR absolute).
Result<std::pair<std::string, std::string>> ParseImageFlag(const std::string& flag);

}  // namespace bragg::pbox
