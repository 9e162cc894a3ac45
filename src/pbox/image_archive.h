#pragma once

// What `pbox image import` accepts, split into layers: a root filesystem tarball (one layer,
// the file itself) or an image archive as `docker save` / `podman save` write it (a tar with
// manifest.json naming the layer tarballs, bottom first).

#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::pbox {

struct ImageLayers {
  std::string format;               // "rootfs" or "docker-archive"
  std::vector<std::string> layers;  // tar files, bottom layer first
};

// Reads the archive at `path`. For an image archive, copies each layer tarball into
// `scratch_dir` (which the caller owns and removes); at most `max_bytes` in all. The first
// image of a multi-image archive is taken. Layer paths are resolved through the archive's
// own symlinks and hard links (docker's legacy "<id>/layer.tar" links into "blobs/sha256/").
// InvalidArgument for a malformed manifest or a layer the archive does not hold.
Result<ImageLayers> SplitImageArchive(const std::string& path, const std::string& scratch_dir,
                                      uint64_t max_bytes);

// Lower-case hex SHA-256 of the file's bytes.
Result<std::string> Sha256File(const std::string& path);

}  // namespace bragg::pbox
