#include "pbox/client/image_cli.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <iostream>

#include "common/fs.h"
#include "common/units.h"
#include "fmt/format.h"
#include "pbox/client/oci_dir_tar.h"

namespace bragg::pbox::client {
namespace {

int Fail(const Status& s) {
  std::cerr << "pbox: " << s.message() << "\n";
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

void ImageCli::Register(CLI::App& app) {
  image_ = app.add_subcommand("image", "import, list and remove images on the agent's node");
  image_->require_subcommand(1);
  import_ = image_->add_subcommand(
      "import",
      "import a root filesystem tarball (plain, gzip, zstd), a docker/podman save archive, "
      "an OCI image layout (podman save --format oci-archive, or its directory); '-' reads "
      "stdin");
  import_->add_option("name", import_name_, "image name, e.g. debian12")->required();
  import_->add_option("file", import_file_, "archive path, OCI layout directory or '-'")
      ->required();
  import_->add_option("--ref", import_ref_,
                      "which image of an archive holding several: a tag (name:tag) or an OCI "
                      "manifest digest (sha256:...)");
  ls_ = image_->add_subcommand("ls", "list images");
  ls_->add_flag("--quiet,-q", quiet_, "names only");
  rm_ = image_->add_subcommand("rm", "remove imported images (their layers stay until prune)");
  rm_->add_option("names", rm_names_, "image names")->required();
  prune_ = image_->add_subcommand("prune", "delete the layers no image or sandbox uses");
}

int ImageCli::Run(Client& client) {
  if (*import_) {
    UniqueFd fd;
    std::unique_ptr<OciDirTar> dir_tar;  // a directory: sent as the tar of its OCI layout
    struct stat st;
    if (import_file_ != "-" && ::stat(import_file_.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      auto started = OciDirTar::Start(import_file_);
      if (!started.ok()) {
        return Fail(started.status());
      }
      dir_tar = std::move(*started);
    } else if (import_file_ != "-") {
      auto opened = OpenFile(import_file_, O_RDONLY);
      if (!opened.ok()) {
        return Fail(opened.status());
      }
      fd = std::move(*opened);
    }
    auto t0 = std::chrono::steady_clock::now();
    int source = dir_tar ? dir_tar->fd() : (fd.valid() ? fd.get() : STDIN_FILENO);
    auto info = client.ImportImage(import_name_, source, import_ref_);
    if (dir_tar) {
      Status sent = dir_tar->Finish();
      if (!sent.ok() && info.ok()) {
        return Fail(sent);
      }
    }
    if (!info.ok()) {
      return Fail(info.status());
    }
    std::cout << fmt::format(
        "imported {} ({}, {} layer{}, {}) in {:.1f} s\n", info->name(), info->format(),
        info->layers_size(), info->layers_size() == 1 ? "" : "s", FormatSize(info->bytes()),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return 0;
  }
  if (*ls_) {
    auto list = client.ListImages();
    if (!list.ok()) {
      return Fail(list.status());
    }
    if (!quiet_) {
      std::cout << fmt::format("{:<24} {:<10} {:<15} {:>6} {:>10} {:>9}\n", "NAME", "KIND",
                               "FORMAT", "LAYERS", "SIZE", "SANDBOXES");
    }
    for (const auto& i : *list) {
      if (quiet_) {
        std::cout << i.name() << "\n";
        continue;
      }
      bool imported = i.kind() == "imported";
      std::cout << fmt::format("{:<24} {:<10} {:<15} {:>6} {:>10} {:>9}\n", i.name(), i.kind(),
                               imported ? i.format() : "-",
                               imported ? std::to_string(i.layers_size()) : "-",
                               imported ? FormatSize(i.bytes()) : "-", i.sandboxes());
    }
    return 0;
  }
  if (*rm_) {
    int rc = 0;
    for (const auto& name : rm_names_) {
      if (Status s = client.RemoveImage(name); !s.ok()) {
        rc = Fail(s);
      }
    }
    return rc;
  }
  if (*prune_) {
    auto pruned = client.PruneImages();
    if (!pruned.ok()) {
      return Fail(pruned.status());
    }
    std::cout << fmt::format("removed {} layer{}, {} freed\n", pruned->removed_layers_size(),
                             pruned->removed_layers_size() == 1 ? "" : "s",
                             FormatSize(pruned->bytes_freed()));
    return 0;
  }
  return 0;
}

}  // namespace bragg::pbox::client
