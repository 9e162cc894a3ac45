#include "common/logging.h"

#include <string>

#include "fmt/format.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace bragg {

Status InitLogging(std::string_view program, std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(
        fmt::format("unknown log level '{}': use trace, debug, info, warn, error or off", level));
  }
  auto logger = spdlog::stderr_color_mt(std::string(program));
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ %n[%P] %v");
  logger->set_level(lvl);
  spdlog::set_default_logger(logger);
  return absl::OkStatus();
}

}  // namespace bragg
