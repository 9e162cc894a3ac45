#pragma once

// A reader for the uncompressed zip archives torch.save writes (stored entries, zip64), located
// anywhere inside a file: a distributed-checkpoint .distcp file holds one archive per tensor chunk
// at (offset, length).

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace bragg::reshard {

// One stored entry: its data lies at [data_offset, data_offset + size) of the underlying file.
struct ZipEntry {
  std::string name;
  uint64_t data_offset = 0;
  uint64_t size = 0;
};

struct ZipLimits {
  uint64_t max_entries = 1'000'000;
  uint64_t max_central_directory = 256ull << 20;
};

// Reads the central directory of the archive occupying [base, base + length) of `fd` with pread
// (the fd is borrowed and must stay open during the call; safe to call from many threads on one
// fd). Every entry must be stored (method 0), lie inside the region and not overlap the central
// directory. InvalidArgument for malformed or compressed archives, naming what is wrong;
// ResourceExhausted past `limits`; the errno error when reading fails.
[[nodiscard]] Result<std::vector<ZipEntry>> ReadZipDirectory(int fd, uint64_t base, uint64_t length,
                                                             const ZipLimits& limits = {});

// Same for an archive held in memory; data_offset is relative to `data`.
[[nodiscard]] Result<std::vector<ZipEntry>> ReadZipDirectoryFromMemory(
    std::string_view data, const ZipLimits& limits = {});

}  // namespace bragg::reshard
