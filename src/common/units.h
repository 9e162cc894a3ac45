#pragma once

// Sizes as people write them on command lines and in configs.

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace bragg {

// "4096", "512K", "512M", "1G", "1.5GiB", "2T", "1P" (binary multiples; K/KB/KiB alike)
// -> bytes.
// InvalidArgument for anything else, negative numbers and values past 2^63.
Result<uint64_t> ParseSize(std::string_view text);

// 1536 -> "1.5KiB"; exact multiples print without decimals ("1GiB").
std::string FormatSize(uint64_t bytes);

}  // namespace bragg
