// bragg-rl run CONFIG.toml [--resume]   the asynchronous RL loop (docs/rl.md)
// bragg-rl check CONFIG.toml            refuses a bad config, prompts or traces; starts nothing
// bragg-rl engine-args CONFIG.toml      bragg-engine's flags for this run, one per line (a Slurm
//                                       job starts engines on its other nodes with them)

#include <linux/limits.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include "common/blas_core.h"
#include "common/logging.h"
#include "rl/config.h"
#include "rl/controller.h"

namespace {

std::string ExeDir() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) {
    return "";
  }
  return std::filesystem::path(std::string(buf, static_cast<size_t>(n))).parent_path().string();
}

int Fail(const bragg::Status& s) {
  std::fprintf(stderr, "bragg-rl: %s\n", std::string(s.message()).c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  bragg::ReexecForKnownBlasCore(argv);  // before anything else runs
  CLI::App app{"bragg-rl: asynchronous RL of language models on tool-using tasks"};
  app.require_subcommand(1);
  std::string config_path, log_level = "info";
  bragg::rl::RunOptions options;
  CLI::App* run = app.add_subcommand("run", "run the loop a config describes");
  run->add_option("config", config_path, "CONFIG.toml")->required();
  run->add_flag("--resume", options.resume, "continue from the run's last checkpoint");
  run->add_option("--log-level", log_level, "trace | debug | info | warn | error");
  std::vector<std::string> engine_urls;
  run->add_option("--engine-url", engine_urls,
                  "an engine to use instead of the config's fleet (repeatable): replaces "
                  "fleet.engine_urls, and bragg-rl starts no engine of its own");
  CLI::App* engine_args = app.add_subcommand(
      "engine-args", "print bragg-engine's flags (but --listen) for this run, one per line");
  engine_args->add_option("config", config_path, "CONFIG.toml")->required();
  CLI::App* check = app.add_subcommand("check", "check a config, its prompts and traces");
  check->add_option("config", config_path, "CONFIG.toml")->required();
  CLI11_PARSE(app, argc, argv);

  if (auto s = bragg::InitLogging("bragg-rl", log_level); !s.ok()) {
    return Fail(s);
  }
  auto config = bragg::rl::LoadConfig(config_path);
  if (!config.ok()) {
    return Fail(config.status());
  }
  if (engine_args->parsed()) {
    auto flags = bragg::rl::EngineArgs(*config);
    if (!flags.ok()) {
      return Fail(flags.status());
    }
    for (const std::string& f : *flags) {
      std::printf("%s\n", f.c_str());
    }
    return 0;
  }
  for (const std::string& url : engine_urls) {
    if (url.rfind("http://", 0) != 0 && url.rfind("https://", 0) != 0) {
      return Fail(absl::InvalidArgumentError("--engine-url " + url + " is not an http:// URL"));
    }
  }
  if (!engine_urls.empty()) {
    config->fleet.engine_urls = engine_urls;
    config->fleet.engines = 0;
  }
  if (check->parsed()) {
    if (auto s = bragg::rl::Preflight(*config); !s.ok()) {
      return Fail(s);
    }
    std::printf("%s: ok\n", config_path.c_str());
    return 0;
  }
  options.bin_dir = ExeDir();
  if (auto s = bragg::rl::Run(*config, options); !s.ok()) {
    return Fail(s);
  }
  return 0;
}
