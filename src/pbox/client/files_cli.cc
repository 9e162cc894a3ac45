#include "pbox/client/files_cli.h"

#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "common/fs.h"
#include "fmt/format.h"

namespace bragg::pbox::client {
namespace {

const char* TypeName(v1::FileType t) {
  switch (t) {
    case v1::FILE_TYPE_REGULAR:
      return "-";
    case v1::FILE_TYPE_DIRECTORY:
      return "d";
    case v1::FILE_TYPE_SYMLINK:
      return "l";
    default:
      return "?";
  }
}

}  // namespace

void CpCli::Register(CLI::App& app) {
  command_ = app.add_subcommand("cp", "copy a file into or out of a sandbox");
  command_->add_option("src", src_, "local path, '-' for stdin, or ID:/path")->required();
  command_->add_option("dst", dst_, "local path, '-' for stdout, or ID:/path")->required();
}

Result<int> CpCli::Run(const Agents& agents) {
  auto [src_id, src_path] = SplitRemote(src_);
  auto [dst_id, dst_path] = SplitRemote(dst_);
  if (src_id.empty() == dst_id.empty()) {
    return absl::InvalidArgumentError(
        "pbox cp: exactly one of SRC and DST must be in a sandbox (ID:/path)");
  }
  BRAGG_ASSIGN_OR_RETURN(Client * client, agents.For(dst_id.empty() ? src_id : dst_id));
  if (!dst_id.empty()) {
    UniqueFd in;
    if (src_path != "-") {
      BRAGG_ASSIGN_OR_RETURN(in, OpenFile(src_path, O_RDONLY));
    }
    BRAGG_RETURN_IF_ERROR(
        client->WriteFileFromFd(dst_id, dst_path, in.valid() ? in.get() : STDIN_FILENO).status());
    return 0;
  }
  UniqueFd out;
  if (dst_path != "-") {
    BRAGG_ASSIGN_OR_RETURN(out, OpenFile(dst_path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  }
  BRAGG_RETURN_IF_ERROR(
      client->ReadFileToFd(src_id, src_path, out.valid() ? out.get() : STDOUT_FILENO).status());
  return 0;
}

void LsCli::Register(CLI::App& app) {
  command_ = app.add_subcommand("ls", "list a directory in a sandbox");
  command_->add_option("target", target_, "ID:/path")->required();
}

Result<int> LsCli::Run(const Agents& agents) {
  auto [id, path] = SplitRemote(target_);
  if (id.empty()) {
    return absl::InvalidArgumentError("pbox ls: expected ID:/path");
  }
  BRAGG_ASSIGN_OR_RETURN(Client * client, agents.For(id));
  BRAGG_ASSIGN_OR_RETURN(auto entries, client->ListDir(id, path.empty() ? "/" : path));
  for (const auto& e : entries) {
    std::cout << fmt::format("{}{:04o} {:>10} {}{}\n", TypeName(e.type()), e.mode(), e.size(),
                             e.path(),
                             e.symlink_target().empty() ? "" : " -> " + e.symlink_target());
  }
  return 0;
}

}  // namespace bragg::pbox::client
