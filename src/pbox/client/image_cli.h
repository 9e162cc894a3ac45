#pragma once

// `pbox image import NAME FILE|DIR [--ref REF] | ls | rm NAME... | prune`: the image subcommands of
// the CLI.

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

#include "pbox/client/client.h"

namespace bragg::pbox::client {

class ImageCli {
 public:
  // Adds the "image" subcommand to `app` (which must outlive this object).
  void Register(CLI::App& app);
  // Whether the user asked for an image subcommand.
  bool selected() const { return image_ != nullptr && *image_; }
  // Runs it; returns the process exit code (errors are printed to stderr).
  int Run(Client& client);

 private:
  CLI::App* image_ = nullptr;
  CLI::App* import_ = nullptr;
  CLI::App* ls_ = nullptr;
  CLI::App* rm_ = nullptr;
  CLI::App* prune_ = nullptr;
  std::string import_name_, import_file_, import_ref_;
  std::vector<std::string> rm_names_;
  bool quiet_ = false;
};

}  // namespace bragg::pbox::client
