#include "pbox/image_archive.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>

#include "common/fs.h"
#include "fmt/format.h"
#include "pbox/layer_unpack.h"

namespace bragg::pbox {
namespace {

constexpr size_t kMaxManifestBytes = 16 << 20;
constexpr int kMaxLinkHops = 8;

// Lexically normalized archive path ("./a/../b" -> "b"); nullopt-like empty string with ok=false
// when it climbs above the archive root.
bool Normalize(std::string_view path, std::string* out) {
  std::vector<std::string_view> parts;
  size_t i = 0;
  while (i <= path.size()) {
    size_t j = path.find('/', i);
    if (j == std::string_view::npos) {
      j = path.size();
    }
    std::string_view part = path.substr(i, j - i);
    if (part == "..") {
      if (parts.empty()) {
        return false;
      }
      parts.pop_back();
    } else if (!part.empty() && part != ".") {
      parts.push_back(part);
    }
    i = j + 1;
  }
  out->clear();
  for (std::string_view p : parts) {
    if (!out->empty()) {
      *out += '/';
    }
    *out += p;
  }
  return true;
}

struct Member {
  bool regular = false;
  std::string link;  // normalized target of a symlink or hard link
};

Status Unexpected(const std::string& path, struct archive* a, uint64_t entries) {
  if (entries == 0) {
    return absl::InvalidArgumentError(fmt::format("{}: not a tar archive (plain, gzip or zstd): {}",
                                                  path, ArchiveErrorString(a)));
  }
  return absl::InvalidArgumentError(fmt::format("{}: malformed archive after {} entries: {}", path,
                                                entries, ArchiveErrorString(a)));
}

}  // namespace

Result<std::string> Sha256File(const std::string& path) {
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("EVP_DigestInit_ex(sha256) failed");
  }
  std::vector<char> buf(1 << 20);
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return ErrnoError("read", path);
    }
    if (n == 0) {
      break;
    }
    EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &len);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex += fmt::format("{:02x}", digest[i]);
  }
  return hex;
}

Result<ImageLayers> SplitImageArchive(const std::string& path, const std::string& scratch_dir,
                                      uint64_t max_bytes) {
  // Pass 1: the members, and manifest.json if there is one.
  std::map<std::string, Member> members;
  std::string manifest;
  bool has_manifest = false;
  {
    BRAGG_ASSIGN_OR_RETURN(ArchivePtr a, OpenTarArchive(path));
    uint64_t entries = 0;
    for (;;) {
      struct archive_entry* e = nullptr;
      int r = archive_read_next_header(a.get(), &e);
      if (r == ARCHIVE_EOF) {
        break;
      }
      if (r != ARCHIVE_OK && r != ARCHIVE_WARN) {
        return Unexpected(path, a.get(), entries);
      }
      ++entries;
      std::string name;
      const char* raw = archive_entry_pathname(e);
      if (raw == nullptr || !Normalize(raw, &name)) {
        continue;  // not a member an image archive could name; a rootfs gets checked later
      }
      Member m;
      m.regular = archive_entry_filetype(e) == AE_IFREG;
      if (const char* hl = archive_entry_hardlink(e); hl != nullptr) {
        m.regular = false;
        if (!Normalize(hl, &m.link)) {
          m.link.clear();
        }
      } else if (archive_entry_filetype(e) == AE_IFLNK && archive_entry_symlink(e) != nullptr) {
        std::string dir =
            name.substr(0, name.rfind('/') == std::string::npos ? 0 : name.rfind('/'));
        if (!Normalize(dir + "/" + archive_entry_symlink(e), &m.link)) {
          m.link.clear();
        }
      }
      if (name == "manifest.json" && m.regular) {
        if (archive_entry_size(e) > static_cast<la_int64_t>(kMaxManifestBytes)) {
          return absl::InvalidArgumentError(
              fmt::format("{}: manifest.json is larger than {} bytes", path, kMaxManifestBytes));
        }
        manifest.resize(static_cast<size_t>(archive_entry_size(e)));
        la_ssize_t n = archive_read_data(a.get(), manifest.data(), manifest.size());
        if (n < 0 || static_cast<size_t>(n) != manifest.size()) {
          return Unexpected(path, a.get(), entries);
        }
        has_manifest = true;
      }
      members[name] = std::move(m);
    }
  }
  if (!has_manifest) {
    return ImageLayers{.format = "rootfs", .layers = {path}};
  }

  // The manifest: [{"Config": ..., "RepoTags": [...], "Layers": ["<path>", ...]}, ...]
  nlohmann::json doc = nlohmann::json::parse(manifest, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_array() || doc.empty() || !doc[0].is_object() ||
      !doc[0].contains("Layers") || !doc[0]["Layers"].is_array()) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: manifest.json is not a docker/podman save manifest (an array of objects with "
        "\"Layers\")",
        path));
  }
  std::vector<std::string> wanted;  // resolved member names, bottom first
  for (const auto& layer : doc[0]["Layers"]) {
    if (!layer.is_string()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: manifest.json: a layer path is not a string", path));
    }
    std::string name;
    if (!Normalize(layer.get<std::string>(), &name) || name.empty()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: manifest.json: layer path \"{}\" leaves the archive", path,
                      layer.get<std::string>()));
    }
    int hops = 0;
    for (;;) {
      auto it = members.find(name);
      if (it == members.end()) {
        return absl::InvalidArgumentError(
            fmt::format("{}: manifest.json names layer \"{}\", which the archive does not hold",
                        path, layer.get<std::string>()));
      }
      if (it->second.regular) {
        break;
      }
      if (it->second.link.empty() || ++hops > kMaxLinkHops) {
        return absl::InvalidArgumentError(
            fmt::format("{}: layer \"{}\" is not a regular file of the archive", path,
                        layer.get<std::string>()));
      }
      name = it->second.link;
    }
    wanted.push_back(name);
  }
  if (wanted.empty()) {
    return absl::InvalidArgumentError(fmt::format("{}: manifest.json lists no layers", path));
  }

  // Pass 2: copy each wanted member out once.
  std::map<std::string, std::string> copies;  // member -> file in scratch_dir
  for (const std::string& w : wanted) {
    copies.emplace(w, fmt::format("{}/layer-{}", scratch_dir, copies.size()));
  }
  BRAGG_ASSIGN_OR_RETURN(ArchivePtr a, OpenTarArchive(path));
  uint64_t entries = 0, total = 0;
  std::set<std::string> done;
  for (;;) {
    struct archive_entry* e = nullptr;
    int r = archive_read_next_header(a.get(), &e);
    if (r == ARCHIVE_EOF) {
      break;
    }
    if (r != ARCHIVE_OK && r != ARCHIVE_WARN) {
      return Unexpected(path, a.get(), entries);
    }
    ++entries;
    std::string name;
    const char* raw = archive_entry_pathname(e);
    if (raw == nullptr || !Normalize(raw, &name) || archive_entry_filetype(e) != AE_IFREG ||
        archive_entry_hardlink(e) != nullptr) {
      continue;
    }
    auto it = copies.find(name);
    if (it == copies.end() || done.count(name) != 0) {
      continue;
    }
    BRAGG_ASSIGN_OR_RETURN(UniqueFd out,
                           OpenFile(it->second, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0600));
    std::vector<char> buf(1 << 20);
    for (;;) {
      la_ssize_t n = archive_read_data(a.get(), buf.data(), buf.size());
      if (n < 0) {
        return Unexpected(path, a.get(), entries);
      }
      if (n == 0) {
        break;
      }
      total += static_cast<uint64_t>(n);
      if (total > max_bytes) {
        return absl::ResourceExhaustedError(
            fmt::format("{}: the layers are larger than the agent's limit of {} bytes (pboxd "
                        "--max-image-bytes)",
                        path, max_bytes));
      }
      BRAGG_RETURN_IF_ERROR(WriteAll(out.get(), std::string_view(buf.data(), n)));
    }
    done.insert(name);
  }
  ImageLayers out{.format = "docker-archive", .layers = {}};
  for (const std::string& w : wanted) {
    if (done.count(w) == 0) {
      return absl::InvalidArgumentError(
          fmt::format("{}: layer \"{}\" vanished between two reads of the archive", path, w));
    }
    out.layers.push_back(copies.at(w));
  }
  return out;
}

}  // namespace bragg::pbox
