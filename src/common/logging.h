#pragma once

// Logging goes through spdlog. Binaries call InitLogging once from main(); libraries log with
// the spdlog free functions (spdlog::info(...)), which use the default logger.

#include <string_view>

#include "common/status.h"

namespace bragg {

// level: trace, debug, info, warn, error, critical, off. Logs go to stderr.
Status InitLogging(std::string_view program, std::string_view level);

}  // namespace bragg
