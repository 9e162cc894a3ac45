#include "pbox/client/exec_cli.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "common/fs.h"
#include "fmt/format.h"

namespace bragg::pbox::client {

void ExecCli::Register(CLI::App& app) {
  command_ = app.add_subcommand("exec", "run a command in a sandbox, streaming its output");
  command_->add_option("id", id_, "sandbox id")->required();
  command_->add_option("--timeout", timeout_s_, "seconds; the command's whole tree is killed then");
  command_->add_option("--env,-e", env_, "KEY=VALUE; repeatable");
  command_->add_option("--cwd,-w", cwd_, "working directory inside the sandbox");
  command_->add_flag("--interactive,-i", interactive_, "forward stdin to the command");
  command_->add_option("command", command_line_, "command and arguments (after --)")->required();
}

Result<int> ExecCli::Run(const Agents& agents) {
  v1::ExecStart start;
  start.set_sandbox_id(id_);
  for (const auto& a : command_line_) {
    start.add_argv(a);
  }
  BRAGG_ASSIGN_OR_RETURN(auto env, ParseEnv(env_));
  start.mutable_env()->insert(env.begin(), env.end());
  start.set_cwd(cwd_);
  start.set_timeout_ms(static_cast<uint64_t>(timeout_s_ * 1000));
  BRAGG_ASSIGN_OR_RETURN(Client * client, agents.For(id_));
  BRAGG_ASSIGN_OR_RETURN(v1::ExecResult result,
                         client->Exec(start, interactive_ ? STDIN_FILENO : -1,
                                      [](bool is_stderr, std::string_view data) {
                                        (void)WriteAll(is_stderr ? STDERR_FILENO : STDOUT_FILENO,
                                                       data);
                                      }));
  if (!result.error().empty()) {
    std::cerr << "pbox: " << result.error() << "\n";
  }
  if (result.timed_out()) {
    std::cerr << fmt::format("pbox: timed out after {:g} s; the command was killed\n", timeout_s_);
    return 124;
  }
  if (result.oom_killed()) {
    std::cerr << "pbox: the command was killed: its sandbox ran out of memory\n";
    return 137;
  }
  if (result.signal() != 0) {
    return 128 + result.signal();
  }
  return result.exit_code();
}

}  // namespace bragg::pbox::client
