#pragma once

// Frozen layers for sandbox cloning. CloneSandbox copies the source sandbox's OverlayFS upper
// directory (its writable layer) into a host directory under the agent's state dir; the
// clones stack that copy as a read-only lower layer above the source's own lower layers, each
// over a fresh writable layer of its own. A frozen layer is shared by every clone made from
// one CloneSandbox call and removed from disk when the last of them lets go of it (cloning a
// clone makes a new layer that keeps the one below it alive).

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::pbox {

// Copies the directory tree open at `src_dir` into `dst` (which must not exist), for use as
// an OverlayFS lower layer: file types, permission bits (setuid included), owners, mtimes,
// every extended attribute (trusted.overlay.opaque and the other overlay markers, user.*,
// security.capability), symlinks as links (never followed), hard links within the tree, and
// whiteouts (0:0 character devices). Other device nodes are skipped (sandboxes cannot make
// them; the sandbox root is nodev anyway). The source is untrusted: every step is relative
// to an fd with O_NOFOLLOW, so a name can never lead outside either tree. On failure `dst` is
// removed.
Status CopyLayerTree(int src_dir, const std::string& dst);

// Most frozen layers one sandbox may stack (clone of a clone of ...): each adds a lowerdir
// to the overlay's mount options, which must fit in a page.
inline constexpr size_t kMaxFrozenDepth = 32;

// One frozen layer on disk. Removed (rm -rf) on destruction. Thread-safe (immutable).
class FrozenLayer {
 public:
  // Copies `src_dir` (the writable layer of a sandbox that itself sits on `below`, or on
  // its image alone when null) into `layers_dir`/`name`.
  static Result<std::shared_ptr<const FrozenLayer>> Create(
      const std::string& layers_dir, const std::string& name, int src_dir,
      std::shared_ptr<const FrozenLayer> below);
  ~FrozenLayer();
  FrozenLayer(const FrozenLayer&) = delete;
  FrozenLayer& operator=(const FrozenLayer&) = delete;

  const std::string& path() const { return path_; }
  // This layer and the ones below it, top first: what goes above the image's lower dirs.
  std::vector<std::string> LowerDirs() const;
  size_t depth() const { return depth_; }

 private:
  FrozenLayer(std::string path, std::shared_ptr<const FrozenLayer> below, size_t depth)
      : path_(std::move(path)), below_(std::move(below)), depth_(depth) {}

  const std::string path_;
  const std::shared_ptr<const FrozenLayer> below_;
  const size_t depth_;
};

}  // namespace bragg::pbox
