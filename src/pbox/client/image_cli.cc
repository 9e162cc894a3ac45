#include "pbox/client/image_cli.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <iostream>

#include "common/fs.h"
#include "common/units.h"
#include "fmt/format.h"

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
      "import a root filesystem tarball (plain, gzip, zstd) or a docker/podman save "
      "archive; '-' reads stdin");
  import_->add_option("name", import_name_, "image name, e.g. debian12")->required();
  import_->add_option("file", import_file_, "archive path or '-'")->required();
  ls_ = image_->add_subcommand("ls", "list images");
  ls_->add_flag("--quiet,-q", quiet_, "names only");
  rm_ = image_->add_subcommand("rm", "remove imported images (their layers stay until prune)");
  rm_->add_option("names", rm_names_, "image names")->required();
  prune_ = image_->add_subcommand("prune", "delete the layers no image or sandbox uses");
}

int ImageCli::Run(Client& client) {
  if (*import_) {
    UniqueFd fd;
    if (import_file_ != "-") {
      auto opened = OpenFile(import_file_, O_RDONLY);
      if (!opened.ok()) {
        return Fail(opened.status());
      }
      fd = std::move(*opened);
    }
    auto t0 = std::chrono::steady_clock::now();
    auto info = client.ImportImage(import_name_, fd.valid() ? fd.get() : STDIN_FILENO);
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
