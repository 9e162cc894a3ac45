#pragma once

// An OCI image layout directory (oci-layout, index.json, blobs/sha256/<hex>), streamed as a
// tar for `pbox image import NAME DIR`: the agent reads it like the tar `podman save --format
// oci-archive` writes, and checks every blob against its digest there.

#include <memory>
#include <string>
#include <thread>

#include "common/status.h"
#include "common/unique_fd.h"

namespace bragg::pbox::client {

class OciDirTar {
 public:
  // Checks that `dir` holds an OCI layout (oci-layout and index.json are regular files) and
  // starts a thread writing the tar into a socket whose other end fd() reads. Only regular
  // files are sent (symlinks are skipped, never followed). InvalidArgument when `dir` is not
  // an OCI layout; the errno's code when it cannot be read.
  static Result<std::unique_ptr<OciDirTar>> Start(const std::string& dir);

  // Closes the reading end (a writer still running sees EPIPE) and joins the thread.
  ~OciDirTar();
  OciDirTar(const OciDirTar&) = delete;
  OciDirTar& operator=(const OciDirTar&) = delete;

  // The tar stream; EOF after the last block. Owned by this object.
  int fd() const { return read_end_.get(); }
  // The writer's outcome; waits for it. A reader that stopped early makes it an error.
  Status Finish();

 private:
  OciDirTar() = default;
  void Write(std::string dir, UniqueFd out);

  UniqueFd read_end_;
  std::thread writer_;
  Status status_;
};

}  // namespace bragg::pbox::client
