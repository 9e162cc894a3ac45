#include "common/serve.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>

#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstdio>
#include <cstring>

namespace bragg {

Result<HostPort> ParseHostPort(std::string_view text) {
  std::string_view rest = text;
  if (rest.starts_with("http://")) {
    rest.remove_prefix(7);
  }
  while (rest.ends_with("/")) {
    rest.remove_suffix(1);
  }
  size_t colon = rest.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || rest.find('/') != std::string_view::npos) {
    return absl::InvalidArgumentError(
        fmt::format("'{}' is not HOST:PORT or http://HOST:PORT", text));
  }
  HostPort hp;
  hp.host = std::string(rest.substr(0, colon));
  std::string_view port = rest.substr(colon + 1);
  auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), hp.port);
  if (ec != std::errc() || ptr != port.data() + port.size() || hp.port < 0 || hp.port > 65535) {
    return absl::InvalidArgumentError(fmt::format("bad port in '{}'", text));
  }
  return hp;
}

sigset_t BlockTerminationSignals() {
  std::signal(SIGPIPE, SIG_IGN);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

Result<uint64_t> RaiseFileLimit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return absl::InternalError(fmt::format("getrlimit(RLIMIT_NOFILE): {}", std::strerror(errno)));
  }
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      return absl::InternalError(
          fmt::format("setrlimit(RLIMIT_NOFILE, {}): {}", rl.rlim_max, std::strerror(errno)));
    }
  }
  return static_cast<uint64_t>(rl.rlim_cur);
}

void WaitForTermination(const sigset_t& set) {
  int sig = 0;
  sigwait(&set, &sig);
}

int ServeUntilTerminated(std::string_view listen,
                         const std::function<Result<std::string>(const HostPort&)>& start,
                         const std::function<void()>& stop) {
  Result<HostPort> hp = ParseHostPort(listen);
  if (!hp.ok()) {
    spdlog::error("--listen: {}", std::string(hp.status().message()));
    return 2;
  }
  if (Result<uint64_t> fds = RaiseFileLimit(); !fds.ok()) {
    spdlog::warn("{}", std::string(fds.status().message()));
  }
  sigset_t set = BlockTerminationSignals();
  Result<std::string> url = start(*hp);
  if (!url.ok()) {
    spdlog::error("{}", std::string(url.status().message()));
    return 1;
  }
  std::printf("listening on %s\n", url->c_str());
  std::fflush(stdout);
  WaitForTermination(set);
  stop();
  return 0;
}

}  // namespace bragg
