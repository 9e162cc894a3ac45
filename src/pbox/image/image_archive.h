#pragma once

// What `pbox image import` accepts, split into layers: a root filesystem tarball (one layer,
// the file itself), an image archive as `docker save` / `podman save` write it (a tar with
// manifest.json naming the layer tarballs, bottom first), or an OCI image layout in a tar
// (`podman save --format oci-archive`, `skopeo copy oci-archive:`; the CLI tars an OCI layout
// directory the same way): oci-layout, index.json -> manifest (through nested indexes) ->
// layer blobs, each blob checked against its digest and size.

#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::pbox {

struct ImageLayers {
  std::string format;               // "rootfs", "docker-archive" or "oci-archive"
  std::vector<std::string> layers;  // tar files, bottom layer first
};

// Reads the archive at `path`. For an image archive, copies each layer tarball into
// `scratch_dir` (which the caller owns and removes); at most `max_bytes` in all. Layer paths
// are resolved through the archive's own symlinks and hard links (docker's legacy
// "<id>/layer.tar" links into "blobs/sha256/"); an OCI blob must resolve to a regular member
// under blobs/.
//
// `ref` picks one image of an archive holding several: a RepoTag of a docker archive, or the
// org.opencontainers.image.ref.name / io.containerd.image.name annotation or the manifest
// digest ("sha256:...") of an OCI index entry; "name" matches "name:latest", and the
// "localhost/" and "docker.io/library/" prefixes are optional. Empty: the archive must hold
// exactly one image. In an OCI index of several platforms the linux one of this machine's
// architecture is taken.
//
// InvalidArgument for a malformed manifest or index, a blob or layer the archive does not
// hold, a digest or size mismatch, an unsupported layer media type, nested indexes deeper
// than 8 or cyclic, an unknown `ref` or an ambiguous archive (the message lists the images);
// ResourceExhausted past `max_bytes`.
Result<ImageLayers> SplitImageArchive(const std::string& path, const std::string& scratch_dir,
                                      uint64_t max_bytes, const std::string& ref = "");

// Lower-case hex SHA-256 of the file's bytes.
Result<std::string> Sha256File(const std::string& path);

}  // namespace bragg::pbox
