#pragma once

// Images a sandbox's root filesystem is built from. An image is a read-only lower layer for
// OverlayFS plus read-only bind mounts of host directories placed into the sandbox root.
//
// "host" (always present): a small skeleton (minimal /etc, /tmp, /proc, /dev mount points, the
// merged-/usr symlinks bin -> usr/bin ...) with the host's /usr bound read-only, so the
// host's programs (python3 with numpy) work without building an image. No host home, root or
// work directory is visible.
// Named directory images (`--image NAME=DIR`): DIR is the lower layer as is.

#include <map>
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

// Thread-safe after construction (read-only).
class ImageStore {
 public:
  // Builds the "host" skeleton under `images_dir`/host (replacing an older one) and checks
  // each named image's directory exists. `host_root` is "/" except in tests.
  static Result<ImageStore> Create(const std::string& images_dir,
                                   const std::map<std::string, std::string>& named,
                                   const std::string& host_root = "/");

  // NotFound with the list of known images if `name` is unknown. "" means "host".
  Result<const Image*> Get(const std::string& name) const;
  std::vector<std::string> Names() const;

 private:
  std::map<std::string, Image> images_;
};

// Parses "NAME=DIR" (NAME: [a-z0-9][a-z0-9._-]*, DIR absolute).
Result<std::pair<std::string, std::string>> ParseImageFlag(const std::string& flag);

}  // namespace bragg::pbox
