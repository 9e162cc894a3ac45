#pragma once

// Test helpers: hex decoding and a writer of stored zip archives (optionally zip64).

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace bragg::reshard::testing {

inline std::string FromHex(std::string_view hex) {
  std::string out;
  for (size_t k = 0; k + 1 < hex.size(); k += 2) {
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(k, 2)), nullptr, 16)));
  }
  return out;
}

inline void PutLe(std::string* s, uint64_t v, int n) {
  for (int k = 0; k < n; ++k) {
    s->push_back(static_cast<char>((v >> (8 * k)) & 0xFF));
  }
}

// Writes entries stored (method 0). With zip64, the central directory carries 0xFFFFFFFF markers
// with a zip64 extra field and the archive ends with zip64 records.
inline std::string MakeZip(const std::vector<std::pair<std::string, std::string>>& entries,
                           bool zip64 = false) {
  std::string out;
  std::string cd;
  for (const auto& [name, data] : entries) {
    uint64_t local = out.size();
    PutLe(&out, 0x04034b50, 4);
    PutLe(&out, 20, 2);
    PutLe(&out, 0, 2);
    PutLe(&out, 0, 2);  // stored
    PutLe(&out, 0, 4);
    PutLe(&out, 0, 4);  // crc (not checked)
    PutLe(&out, data.size(), 4);
    PutLe(&out, data.size(), 4);
    PutLe(&out, name.size(), 2);
    PutLe(&out, 0, 2);
    out += name;
    out += data;
    PutLe(&cd, 0x02014b50, 4);
    PutLe(&cd, 45, 2);
    PutLe(&cd, 45, 2);
    PutLe(&cd, 0, 2);
    PutLe(&cd, 0, 2);
    PutLe(&cd, 0, 4);
    PutLe(&cd, 0, 4);
    PutLe(&cd, zip64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&cd, zip64 ? 0xFFFFFFFF : data.size(), 4);
    PutLe(&cd, name.size(), 2);
    PutLe(&cd, zip64 ? 28 : 0, 2);
    PutLe(&cd, 0, 2);
    PutLe(&cd, 0, 2);
    PutLe(&cd, 0, 2);
    PutLe(&cd, 0, 4);
    PutLe(&cd, zip64 ? 0xFFFFFFFF : local, 4);
    cd += name;
    if (zip64) {
      PutLe(&cd, 1, 2);
      PutLe(&cd, 24, 2);
      PutLe(&cd, data.size(), 8);
      PutLe(&cd, data.size(), 8);
      PutLe(&cd, local, 8);
    }
  }
  uint64_t cd_off = out.size();
  out += cd;
  if (zip64) {
    uint64_t rec = out.size();
    PutLe(&out, 0x06064b50, 4);
    PutLe(&out, 44, 8);
    PutLe(&out, 45, 2);
    PutLe(&out, 45, 2);
    PutLe(&out, 0, 4);
    PutLe(&out, 0, 4);
    PutLe(&out, entries.size(), 8);
    PutLe(&out, entries.size(), 8);
    PutLe(&out, cd.size(), 8);
    PutLe(&out, cd_off, 8);
    PutLe(&out, 0x07064b50, 4);
    PutLe(&out, 0, 4);
    PutLe(&out, rec, 8);
    PutLe(&out, 1, 4);
  }
  PutLe(&out, 0x06054b50, 4);
  PutLe(&out, 0, 2);
  PutLe(&out, 0, 2);
  PutLe(&out, zip64 ? 0xFFFF : entries.size(), 2);
  PutLe(&out, zip64 ? 0xFFFF : entries.size(), 2);
  PutLe(&out, zip64 ? 0xFFFFFFFF : cd.size(), 4);
  PutLe(&out, zip64 ? 0xFFFFFFFF : cd_off, 4);
  PutLe(&out, 0, 2);
  return out;
}

}  // namespace bragg::reshard::testing
