#pragma once

// For benchmarks that drive real Bragg binaries: spawn one that prints "listening on URL" (the
// line every Bragg server prints when it is ready, common/serve.h) and wait for that line.

#include <fcntl.h>
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/fs.h"
#include "common/process.h"
#include "common/serve.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace bragg::bench {

struct ListeningChild {
  ChildProcess proc;
  int port = 0;
};

// Spawns `argv` with stdout and stderr to `log` and waits up to 30 s for "listening on URL".
inline Result<ListeningChild> StartListeningChild(const std::vector<std::string>& argv,
                                                  const std::string& log) {
  int fd = ::open(log.c_str(), O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(fmt::format("open {}: {}", log, std::strerror(errno)));
  }
  UniqueFd owned(fd);
  SpawnOptions so;
  so.stdout_fd = fd;
  so.stderr_fd = fd;
  BRAGG_ASSIGN_OR_RETURN(ChildProcess proc, Spawn(argv, so));
  for (int i = 0; i < 600; ++i) {
    auto text = ReadFileToString(log);
    size_t at = text.ok() ? text->find("listening on ") : std::string::npos;
    if (at != std::string::npos && text->find('\n', at) != std::string::npos) {
      std::string url = text->substr(at + 13, text->find('\n', at) - at - 13);
      BRAGG_ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(url));
      return ListeningChild{std::move(proc), hp.port};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(fmt::format("{} never said 'listening on'", argv[0]));
}

}  // namespace bragg::bench
