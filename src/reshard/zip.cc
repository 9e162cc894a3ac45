#include "reshard/zip.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>

namespace bragg::reshard {

namespace {

using ReadFn = std::function<Status(uint64_t off, size_t n, char* out)>;

uint64_t Le(const char* p, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) {
    v = (v << 8) | static_cast<uint8_t>(p[k]);
  }
  return v;
}

Status Bad(std::string_view what) {
  return absl::InvalidArgumentError(fmt::format("malformed zip archive: {}", what));
}

Result<std::vector<ZipEntry>> ReadDirectory(const ReadFn& read, uint64_t length,
                                            const ZipLimits& limits) {
  if (length < 22) {
    return Bad(fmt::format("{} bytes is too short for an end-of-central-directory record", length));
  }
  // The EOCD record sits in the last 22 + 65535 bytes (its comment is at most 64 KiB).
  uint64_t tail_len = std::min<uint64_t>(length, 22 + 65535);
  std::string tail(tail_len, '\0');
  BRAGG_RETURN_IF_ERROR(read(length - tail_len, tail_len, tail.data()));
  int64_t eocd = -1;
  for (int64_t k = static_cast<int64_t>(tail_len) - 22; k >= 0; --k) {
    if (Le(&tail[k], 4) == 0x06054b50 &&
        static_cast<uint64_t>(k) + 22 + Le(&tail[k + 20], 2) == tail_len) {
      eocd = k;
      break;
    }
  }
  if (eocd < 0) {
    return Bad("no end-of-central-directory record");
  }
  const char* e = &tail[eocd];
  uint64_t eocd_abs = length - tail_len + static_cast<uint64_t>(eocd);
  uint64_t entries = Le(e + 10, 2);
  uint64_t cd_size = Le(e + 12, 4);
  uint64_t cd_off = Le(e + 16, 4);
  if (Le(e + 4, 2) != 0 || Le(e + 6, 2) != 0) {
    return Bad("multi-disk archives are not supported");
  }
  if (entries == 0xFFFF || cd_size == 0xFFFFFFFF || cd_off == 0xFFFFFFFF) {
    if (eocd_abs < 20) {
      return Bad("zip64 markers without a zip64 locator");
    }
    char loc[20];
    BRAGG_RETURN_IF_ERROR(read(eocd_abs - 20, 20, loc));
    if (Le(loc, 4) != 0x07064b50) {
      return Bad("zip64 markers without a zip64 locator");
    }
    uint64_t rec_off = Le(loc + 8, 8);
    if (rec_off > eocd_abs - 20 || eocd_abs - 20 - rec_off < 56) {
      return Bad("zip64 end-of-central-directory record out of range");
    }
    char rec[56];
    BRAGG_RETURN_IF_ERROR(read(rec_off, 56, rec));
    if (Le(rec, 4) != 0x06064b50) {
      return Bad("bad zip64 end-of-central-directory signature");
    }
    entries = Le(rec + 32, 8);
    cd_size = Le(rec + 40, 8);
    cd_off = Le(rec + 48, 8);
    eocd_abs = rec_off;
  }
  if (cd_off > eocd_abs || cd_size > eocd_abs - cd_off) {
    return Bad(fmt::format("central directory [{}, +{}) out of range", cd_off, cd_size));
  }
  if (cd_size > limits.max_central_directory) {
    return absl::ResourceExhaustedError(
        fmt::format("zip central directory of {} bytes exceeds the limit", cd_size));
  }
  if (entries > limits.max_entries) {
    return absl::ResourceExhaustedError(
        fmt::format("zip with {} entries exceeds the limit of {}", entries, limits.max_entries));
  }
  if (entries > cd_size / 46) {
    return Bad(
        fmt::format("{} entries cannot fit in a {}-byte central directory", entries, cd_size));
  }
  std::string cd(cd_size, '\0');
  BRAGG_RETURN_IF_ERROR(read(cd_off, cd_size, cd.data()));
  std::vector<ZipEntry> out;
  out.reserve(entries);
  uint64_t p = 0;
  for (uint64_t n = 0; n < entries; ++n) {
    if (cd_size - p < 46 || Le(&cd[p], 4) != 0x02014b50) {
      return Bad(fmt::format("central directory entry {} is malformed", n));
    }
    const char* h = &cd[p];
    uint64_t flags = Le(h + 8, 2);
    uint64_t method = Le(h + 10, 2);
    uint64_t csize = Le(h + 20, 4);
    uint64_t usize = Le(h + 24, 4);
    uint64_t name_len = Le(h + 28, 2);
    uint64_t extra_len = Le(h + 30, 2);
    uint64_t comment_len = Le(h + 32, 2);
    uint64_t local = Le(h + 42, 4);
    if (cd_size - p - 46 < name_len + extra_len + comment_len) {
      return Bad(fmt::format("central directory entry {} overruns the directory", n));
    }
    ZipEntry entry;
    entry.name.assign(h + 46, name_len);
    const char* x = h + 46 + name_len;
    const char* x_end = x + extra_len;
    while (x_end - x >= 4) {
      uint64_t id = Le(x, 2);
      uint64_t len = Le(x + 2, 2);
      if (static_cast<uint64_t>(x_end - x - 4) < len) {
        return Bad(fmt::format("extra field of '{}' overruns its entry", entry.name));
      }
      if (id == 0x0001) {
        const char* z = x + 4;
        uint64_t left = len;
        auto take = [&](uint64_t* field) -> Status {
          if (*field == 0xFFFFFFFF) {
            if (left < 8) {
              return Bad(fmt::format("short zip64 extra field in '{}'", entry.name));
            }
            *field = Le(z, 8);
            z += 8;
            left -= 8;
          }
          return absl::OkStatus();
        };
        BRAGG_RETURN_IF_ERROR(take(&usize));
        BRAGG_RETURN_IF_ERROR(take(&csize));
        BRAGG_RETURN_IF_ERROR(take(&local));
      }
      x += 4 + len;
    }
    if (method != 0 || csize != usize) {
      return absl::UnimplementedError(
          fmt::format("zip entry '{}' is compressed (method {}); torch.save archives are stored",
                      entry.name, method));
    }
    if (flags & 1) {
      return absl::UnimplementedError(fmt::format("zip entry '{}' is encrypted", entry.name));
    }
    if (local > cd_off || cd_off - local < 30) {
      return Bad(fmt::format("local header of '{}' out of range", entry.name));
    }
    char lh[30];
    BRAGG_RETURN_IF_ERROR(read(local, 30, lh));
    if (Le(lh, 4) != 0x04034b50) {
      return Bad(fmt::format("bad local header signature for '{}'", entry.name));
    }
    uint64_t data = local + 30 + Le(lh + 26, 2) + Le(lh + 28, 2);
    if (data > cd_off || usize > cd_off - data) {
      return Bad(fmt::format("data of '{}' ({} bytes at {}) overruns the archive", entry.name,
                             usize, data));
    }
    entry.data_offset = data;
    entry.size = usize;
    out.push_back(std::move(entry));
    p += 46 + name_len + extra_len + comment_len;
  }
  return out;
}

}  // namespace

Result<std::vector<ZipEntry>> ReadZipDirectory(int fd, uint64_t base, uint64_t length,
                                               const ZipLimits& limits) {
  ReadFn read = [&](uint64_t off, size_t n, char* out) -> Status {
    size_t done = 0;
    while (done < n) {
      ssize_t r = ::pread(fd, out + done, n - done, static_cast<off_t>(base + off + done));
      if (r < 0) {
        if (errno == EINTR) {
          continue;
        }
        return ErrnoError("pread", fmt::format("zip at offset {}", base + off + done));
      }
      if (r == 0) {
        return Bad(fmt::format("file ends before byte {} of the archive", off + done));
      }
      done += static_cast<size_t>(r);
    }
    return absl::OkStatus();
  };
  BRAGG_ASSIGN_OR_RETURN(auto entries, ReadDirectory(read, length, limits));
  for (ZipEntry& e : entries) {
    e.data_offset += base;
  }
  return entries;
}

Result<std::vector<ZipEntry>> ReadZipDirectoryFromMemory(std::string_view data,
                                                         const ZipLimits& limits) {
  ReadFn read = [&](uint64_t off, size_t n, char* out) -> Status {
    if (off > data.size() || n > data.size() - off) {
      return Bad("read past the end of the archive");
    }
    std::memcpy(out, data.data() + off, n);
    return absl::OkStatus();
  };
  return ReadDirectory(read, data.size(), limits);
}

}  // namespace bragg::reshard
