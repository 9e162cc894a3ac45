#include "pbox/image/image_archive.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>

#include "common/fs.h"
#include "fmt/format.h"
#include "pbox/image/layer_unpack.h"

namespace bragg::pbox {
namespace {

constexpr size_t kMaxManifestBytes = 16 << 20;
constexpr int kMaxLinkHops = 8;
// Small blobs kept from the first read (manifests and indexes are a few KiB).
constexpr size_t kMaxCachedBlobBytes = 1 << 20;
constexpr size_t kMaxCachedBytes = 16 << 20;

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

// The data of the member the archive is positioned at, at most `limit` bytes. The header's
// size is not trusted (a crafted header can say anything, negative included): the data is
// read in chunks and refused past the limit.
Result<std::string> ReadMemberData(const std::string& path, struct archive* a, uint64_t entries,
                                   const std::string& name, size_t limit) {
  std::string data;
  char buf[64 << 10];
  for (;;) {
    la_ssize_t n = archive_read_data(a, buf, sizeof(buf));
    if (n < 0) {
      return Unexpected(path, a, entries);
    }
    if (n == 0) {
      return data;
    }
    if (data.size() + static_cast<size_t>(n) > limit) {
      return absl::InvalidArgumentError(
          fmt::format("{}: {} is larger than {} bytes", path, name, limit));
    }
    data.append(buf, static_cast<size_t>(n));
  }
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

namespace {

// Contents of selected regular members, read in one pass over the archive.
Status ReadMembers(const std::string& path, const std::set<std::string>& names,
                   std::map<std::string, std::string>* out) {
  BRAGG_ASSIGN_OR_RETURN(ArchivePtr a, OpenTarArchive(path));
  uint64_t entries = 0;
  for (;;) {
    struct archive_entry* e = nullptr;
    int r = archive_read_next_header(a.get(), &e);
    if (r == ARCHIVE_EOF) {
      return absl::OkStatus();
    }
    if (r != ARCHIVE_OK && r != ARCHIVE_WARN) {
      return Unexpected(path, a.get(), entries);
    }
    ++entries;
    std::string name;
    const char* raw = archive_entry_pathname(e);
    if (raw == nullptr || !Normalize(raw, &name) || archive_entry_filetype(e) != AE_IFREG ||
        archive_entry_hardlink(e) != nullptr || names.count(name) == 0 || out->count(name) != 0) {
      continue;
    }
    BRAGG_ASSIGN_OR_RETURN(std::string data,
                           ReadMemberData(path, a.get(), entries, name, kMaxManifestBytes));
    (*out)[name] = std::move(data);
  }
}

// Follows the archive's own links from `name` to a regular member; empty when there is none.
std::string ResolveMember(const std::map<std::string, Member>& members, std::string name) {
  for (int hops = 0; hops <= kMaxLinkHops; ++hops) {
    auto it = members.find(name);
    if (it == members.end()) {
      return "";
    }
    if (it->second.regular) {
      return name;
    }
    if (it->second.link.empty()) {
      return "";
    }
    name = it->second.link;
  }
  return "";
}

std::string HexDigest(EVP_MD_CTX* ctx) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, digest, &len);
  std::string hex;
  for (unsigned int i = 0; i < len; ++i) {
    hex += fmt::format("{:02x}", digest[i]);
  }
  return hex;
}

using DigestCtx = std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)>;

Result<DigestCtx> NewSha256() {
  DigestCtx ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("EVP_DigestInit_ex(sha256) failed");
  }
  return ctx;
}

// "localhost/a:latest", "docker.io/library/a", "a" -> "a:latest".
std::string NormalizeRef(std::string r) {
  for (const char* prefix : {"docker.io/library/", "docker.io/", "localhost/"}) {
    if (r.rfind(prefix, 0) == 0) {
      r = r.substr(std::strlen(prefix));
      break;
    }
  }
  const size_t slash = r.rfind('/');
  const size_t colon = r.rfind(':');
  if (r.find('@') == std::string::npos &&
      (colon == std::string::npos || (slash != std::string::npos && colon < slash))) {
    r += ":latest";
  }
  return r;
}

// One image an archive offers: how it may be named, and what to report for it.
struct Candidate {
  std::vector<std::string> names;
  std::string digest;  // OCI: the descriptor's "sha256:..."
  std::string Label(size_t index) const {
    if (!names.empty()) {
      std::string out;
      for (const std::string& n : names) {
        out += (out.empty() ? "" : " ") + n;
      }
      return out;
    }
    return digest.empty() ? fmt::format("(untagged image {})", index + 1)
                          : fmt::format("(untagged) {}", digest);
  }
  bool Matches(const std::string& ref) const {
    if (!digest.empty() && ref == digest) {
      return true;
    }
    for (const std::string& n : names) {
      if (n == ref || NormalizeRef(n) == NormalizeRef(ref)) {
        return true;
      }
    }
    return false;
  }
};

// The index of the image `ref` names among `candidates` (see SplitImageArchive).
Result<size_t> PickImage(const std::string& path, const std::vector<Candidate>& candidates,
                         const std::string& ref) {
  std::string choices;
  for (size_t i = 0; i < candidates.size(); ++i) {
    choices += fmt::format("{}{}", i == 0 ? "" : ", ", candidates[i].Label(i));
  }
  if (candidates.empty()) {
    return absl::InvalidArgumentError(fmt::format("{}: the archive holds no image", path));
  }
  if (ref.empty()) {
    if (candidates.size() == 1) {
      return 0;
    }
    return absl::InvalidArgumentError(
        fmt::format("{}: the archive holds {} images; pick one with --ref (one of: {})", path,
                    candidates.size(), choices));
  }
  std::vector<size_t> hits;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i].Matches(ref)) {
      hits.push_back(i);
    }
  }
  if (hits.size() == 1) {
    return hits[0];
  }
  return absl::InvalidArgumentError(fmt::format(
      "{}: --ref {} {} (the archive holds: {})", path, ref,
      hits.empty() ? "names no image of the archive" : "names several images", choices));
}

bool IsIndexType(const std::string& t) {
  return t == "application/vnd.oci.image.index.v1+json" ||
         t == "application/vnd.docker.distribution.manifest.list.v2+json";
}

bool IsManifestType(const std::string& t) {
  return t == "application/vnd.oci.image.manifest.v1+json" ||
         t == "application/vnd.docker.distribution.manifest.v2+json";
}

bool IsLayerType(const std::string& t) {
  static const std::set<std::string> kTypes = {
      "application/vnd.oci.image.layer.v1.tar",
      "application/vnd.oci.image.layer.v1.tar+gzip",
      "application/vnd.oci.image.layer.v1.tar+zstd",
      "application/vnd.oci.image.layer.nondistributable.v1.tar",
      "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
      "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
      "application/vnd.docker.image.rootfs.diff.tar",
      "application/vnd.docker.image.rootfs.diff.tar.gzip",
      "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
  };
  return kTypes.count(t) != 0;
}

const char* HostArch() {
#if defined(__x86_64__)
  return "amd64";
#elif defined(__aarch64__)
  return "arm64";
#else
  return "";
#endif
}

struct Descriptor {
  std::string media_type;  // may be empty (older writers)
  std::string hex;         // of a sha256 digest
  uint64_t size = 0;
  nlohmann::json annotations;  // an object, or null
  nlohmann::json platform;     // an object, or null
  std::string digest() const { return "sha256:" + hex; }
};

Result<Descriptor> ParseDescriptor(const std::string& path, const nlohmann::json& j,
                                   const std::string& where) {
  if (!j.is_object() || !j.contains("digest") || !j["digest"].is_string() || !j.contains("size") ||
      !j["size"].is_number_unsigned()) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: {}: a descriptor needs a string \"digest\" and an unsigned \"size\"", path, where));
  }
  Descriptor d;
  const std::string digest = j["digest"].get<std::string>();
  if (digest.rfind("sha256:", 0) != 0 || digest.size() != 7 + 64 ||
      digest.find_first_not_of("0123456789abcdef", 7) != std::string::npos) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: {}: digest \"{}\" is not sha256:<64 lower-case hex digits>", path, where, digest));
  }
  d.hex = digest.substr(7);
  d.size = j["size"].get<uint64_t>();
  if (j.contains("mediaType")) {
    if (!j["mediaType"].is_string()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: {}: \"mediaType\" is not a string", path, where));
    }
    d.media_type = j["mediaType"].get<std::string>();
  }
  if (j.contains("annotations") && j["annotations"].is_object()) {
    d.annotations = j["annotations"];
  }
  if (j.contains("platform") && j["platform"].is_object()) {
    d.platform = j["platform"];
  }
  return d;
}

std::string JsonString(const nlohmann::json& obj, const char* key) {
  if (obj.is_object() && obj.contains(key) && obj[key].is_string()) {
    return obj[key].get<std::string>();
  }
  return "";
}

// An OCI image layout read from a tar: blobs by digest, checked against their descriptors.
class OciLayout {
 public:
  OciLayout(const std::string& path, const std::map<std::string, Member>& members,
            std::map<std::string, std::string>* contents)
      : path_(path), members_(members), contents_(contents) {}

  // The member holding the blob of `d`: a regular file under blobs/.
  Result<std::string> BlobMember(const Descriptor& d) const {
    const std::string name = ResolveMember(members_, "blobs/sha256/" + d.hex);
    if (name.empty()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: blob {} is not a regular file of the archive", path_, d.digest()));
    }
    if (name.rfind("blobs/", 0) != 0) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: blob {} links to \"{}\", outside the layout's blobs/", path_, d.digest(), name));
    }
    return name;
  }

  // A JSON blob (index or manifest), its size and digest checked.
  Result<nlohmann::json> ReadJson(const Descriptor& d) {
    if (d.size > kMaxManifestBytes) {
      return absl::InvalidArgumentError(
          fmt::format("{}: {} claims {} bytes, more than {} for a "
                      "manifest or index",
                      path_, d.digest(), d.size, kMaxManifestBytes));
    }
    BRAGG_ASSIGN_OR_RETURN(std::string name, BlobMember(d));
    if (contents_->count(name) == 0) {
      BRAGG_RETURN_IF_ERROR(ReadMembers(path_, {name}, contents_));
    }
    const std::string& data = (*contents_)[name];
    BRAGG_ASSIGN_OR_RETURN(DigestCtx ctx, NewSha256());
    EVP_DigestUpdate(ctx.get(), data.data(), data.size());
    if (data.size() != d.size || HexDigest(ctx.get()) != d.hex) {
      return absl::InvalidArgumentError(
          fmt::format("{}: blob {} does not match its descriptor (digest or size {} != {})", path_,
                      d.digest(), data.size(), d.size));
    }
    nlohmann::json doc = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded() || !doc.is_object()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: blob {} is not a JSON object", path_, d.digest()));
    }
    return doc;
  }

  // Follows `d` through nested indexes (this machine's platform where there are several) to
  // an image manifest.
  Result<nlohmann::json> ResolveManifest(Descriptor d) {
    std::set<std::string> seen;
    for (int depth = 0;; ++depth) {
      if (depth > kMaxIndexDepth) {
        return absl::InvalidArgumentError(fmt::format(
            "{}: indexes nested deeper than {} levels below index.json", path_, kMaxIndexDepth));
      }
      if (!seen.insert(d.hex).second) {
        return absl::InvalidArgumentError(
            fmt::format("{}: index {} refers back to itself (a cycle)", path_, d.digest()));
      }
      if (!d.media_type.empty() && !IsIndexType(d.media_type) && !IsManifestType(d.media_type)) {
        return absl::InvalidArgumentError(
            fmt::format("{}: {} has media type {}, not an image manifest or index", path_,
                        d.digest(), d.media_type));
      }
      BRAGG_ASSIGN_OR_RETURN(nlohmann::json doc, ReadJson(d));
      const bool is_index =
          IsIndexType(d.media_type) ||
          (d.media_type.empty() && doc.contains("manifests") && !doc.contains("layers"));
      if (!is_index) {
        if (!doc.contains("layers") || !doc["layers"].is_array()) {
          return absl::InvalidArgumentError(
              fmt::format("{}: manifest {} has no \"layers\" array", path_, d.digest()));
        }
        return doc;
      }
      if (!doc.contains("manifests") || !doc["manifests"].is_array() || doc["manifests"].empty()) {
        return absl::InvalidArgumentError(
            fmt::format("{}: index {} lists no manifests", path_, d.digest()));
      }
      const nlohmann::json& list = doc["manifests"];
      std::optional<Descriptor> pick;
      std::string platforms;
      for (size_t i = 0; i < list.size(); ++i) {
        BRAGG_ASSIGN_OR_RETURN(
            Descriptor entry, ParseDescriptor(path_, list[i], fmt::format("index {}", d.digest())));
        const std::string os = JsonString(entry.platform, "os");
        const std::string arch = JsonString(entry.platform, "architecture");
        platforms += fmt::format("{}{}/{}", platforms.empty() ? "" : ", ", os.empty() ? "?" : os,
                                 arch.empty() ? "?" : arch);
        if (list.size() == 1 || (os == "linux" && arch == HostArch() && !pick.has_value())) {
          pick = std::move(entry);
        }
      }
      if (!pick.has_value()) {
        return absl::InvalidArgumentError(
            fmt::format("{}: index {} has no image for linux/{} (it has: {})", path_, d.digest(),
                        HostArch(), platforms));
      }
      d = std::move(*pick);
    }
  }

 private:
  static constexpr int kMaxIndexDepth = 8;
  const std::string& path_;
  const std::map<std::string, Member>& members_;
  std::map<std::string, std::string>* contents_;
};

struct Wanted {
  std::string member;
  std::optional<Descriptor> check;  // OCI: the digest and size the copy must have
};

// Copies each wanted member out once into `scratch_dir`, checking digests where asked.
Result<std::vector<std::string>> CopyLayers(const std::string& path,
                                            const std::vector<Wanted>& wanted,
                                            const std::string& scratch_dir, uint64_t max_bytes) {
  std::map<std::string, std::string> copies;  // member -> file in scratch_dir
  std::map<std::string, const Descriptor*> checks;
  for (const Wanted& w : wanted) {
    copies.emplace(w.member, fmt::format("{}/layer-{}", scratch_dir, copies.size()));
    if (w.check.has_value()) {
      checks.emplace(w.member, &*w.check);
    }
  }
  BRAGG_ASSIGN_OR_RETURN(ArchivePtr a, OpenTarArchive(path));
  uint64_t entries = 0, total = 0;
  std::set<std::string> done;
  std::vector<char> buf(1 << 20);
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
    const Descriptor* check = checks.count(name) != 0 ? checks.at(name) : nullptr;
    DigestCtx ctx(nullptr, EVP_MD_CTX_free);
    if (check != nullptr) {
      BRAGG_ASSIGN_OR_RETURN(ctx, NewSha256());
    }
    BRAGG_ASSIGN_OR_RETURN(UniqueFd out,
                           OpenFile(it->second, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW, 0600));
    uint64_t size = 0;
    for (;;) {
      la_ssize_t n = archive_read_data(a.get(), buf.data(), buf.size());
      if (n < 0) {
        return Unexpected(path, a.get(), entries);
      }
      if (n == 0) {
        break;
      }
      total += static_cast<uint64_t>(n);
      size += static_cast<uint64_t>(n);
      if (total > max_bytes) {
        return absl::ResourceExhaustedError(
            fmt::format("{}: the layers are larger than the agent's limit of {} bytes (pboxd "
                        "--max-image-bytes)",
                        path, max_bytes));
      }
      if (check != nullptr) {
        EVP_DigestUpdate(ctx.get(), buf.data(), static_cast<size_t>(n));
      }
      BRAGG_RETURN_IF_ERROR(WriteAll(out.get(), std::string_view(buf.data(), n)));
    }
    if (check != nullptr && (size != check->size || HexDigest(ctx.get()) != check->hex)) {
      return absl::InvalidArgumentError(
          fmt::format("{}: layer blob {} does not match its descriptor (digest, or size {} != {})",
                      path, check->digest(), size, check->size));
    }
    done.insert(name);
  }
  std::vector<std::string> out;
  for (const Wanted& w : wanted) {
    if (done.count(w.member) == 0) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: layer \"{}\" vanished between two reads of the archive", path, w.member));
    }
    out.push_back(copies.at(w.member));
  }
  return out;
}

Result<std::vector<Wanted>> DockerLayers(const std::string& path,
                                         const std::map<std::string, Member>& members,
                                         const std::string& manifest, const std::string& ref) {
  // The manifest: [{"Config": ..., "RepoTags": [...], "Layers": ["<path>", ...]}, ...]
  nlohmann::json doc = nlohmann::json::parse(manifest, nullptr, /*allow_exceptions=*/false);
  bool shaped = !doc.is_discarded() && doc.is_array() && !doc.empty();
  std::vector<Candidate> candidates;
  for (size_t i = 0; shaped && i < doc.size(); ++i) {
    if (!doc[i].is_object() || !doc[i].contains("Layers") || !doc[i]["Layers"].is_array()) {
      shaped = false;
      break;
    }
    Candidate c;
    if (doc[i].contains("RepoTags") && doc[i]["RepoTags"].is_array()) {
      for (const auto& tag : doc[i]["RepoTags"]) {
        if (tag.is_string()) {
          c.names.push_back(tag.get<std::string>());
        }
      }
    }
    candidates.push_back(std::move(c));
  }
  if (!shaped) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: manifest.json is not a docker/podman save manifest (an array of objects with "
        "\"Layers\")",
        path));
  }
  BRAGG_ASSIGN_OR_RETURN(size_t pick, PickImage(path, candidates, ref));
  std::vector<Wanted> wanted;  // resolved member names, bottom first
  for (const auto& layer : doc[pick]["Layers"]) {
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
    if (members.count(name) == 0) {
      return absl::InvalidArgumentError(
          fmt::format("{}: manifest.json names layer \"{}\", which the archive does not hold", path,
                      layer.get<std::string>()));
    }
    std::string resolved = ResolveMember(members, name);
    if (resolved.empty()) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: layer \"{}\" is not a regular file of the archive", path, layer.get<std::string>()));
    }
    wanted.push_back({resolved, std::nullopt});
  }
  if (wanted.empty()) {
    return absl::InvalidArgumentError(fmt::format("{}: manifest.json lists no layers", path));
  }
  return wanted;
}

Result<std::vector<Wanted>> OciLayers(const std::string& path,
                                      const std::map<std::string, Member>& members,
                                      std::map<std::string, std::string>* contents,
                                      const std::string& ref, uint64_t max_bytes) {
  const std::string& index_text = (*contents)["index.json"];
  nlohmann::json index = nlohmann::json::parse(index_text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object() || !index.contains("manifests") ||
      !index["manifests"].is_array()) {
    return absl::InvalidArgumentError(fmt::format(
        "{}: index.json is not an OCI image index (an object with a \"manifests\" array)", path));
  }
  std::vector<Descriptor> entries;
  std::vector<Candidate> candidates;
  for (const auto& m : index["manifests"]) {
    BRAGG_ASSIGN_OR_RETURN(Descriptor d, ParseDescriptor(path, m, "index.json"));
    Candidate c;
    c.digest = d.digest();
    for (const char* key : {"io.containerd.image.name", "org.opencontainers.image.ref.name"}) {
      if (std::string n = JsonString(d.annotations, key); !n.empty()) {
        c.names.push_back(std::move(n));
      }
    }
    entries.push_back(std::move(d));
    candidates.push_back(std::move(c));
  }
  BRAGG_ASSIGN_OR_RETURN(size_t pick, PickImage(path, candidates, ref));
  OciLayout layout(path, members, contents);
  BRAGG_ASSIGN_OR_RETURN(nlohmann::json manifest, layout.ResolveManifest(entries[pick]));
  std::vector<Wanted> wanted;
  uint64_t total = 0;
  for (const auto& l : manifest["layers"]) {
    BRAGG_ASSIGN_OR_RETURN(Descriptor d, ParseDescriptor(path, l, "manifest layer"));
    if (!IsLayerType(d.media_type)) {
      return absl::InvalidArgumentError(
          fmt::format("{}: layer {} has media type \"{}\", not a tar layer (plain, gzip or zstd)",
                      path, d.digest(), d.media_type));
    }
    total += d.size;
    if (d.size > max_bytes || total > max_bytes) {
      return absl::ResourceExhaustedError(
          fmt::format("{}: the layers are larger than the agent's limit of {} bytes (pboxd "
                      "--max-image-bytes)",
                      path, max_bytes));
    }
    BRAGG_ASSIGN_OR_RETURN(std::string member, layout.BlobMember(d));
    wanted.push_back({member, d});
  }
  if (wanted.empty()) {
    return absl::InvalidArgumentError(fmt::format("{}: the image manifest lists no layers", path));
  }
  return wanted;
}

}  // namespace

Result<ImageLayers> SplitImageArchive(const std::string& path, const std::string& scratch_dir,
                                      uint64_t max_bytes, const std::string& ref) {
  // Pass 1: the members; manifest.json, index.json and oci-layout; small blobs (manifests and
  // indexes, usually), so that resolving an OCI image needs no further pass.
  std::map<std::string, Member> members;
  std::map<std::string, std::string> contents;
  {
    BRAGG_ASSIGN_OR_RETURN(ArchivePtr a, OpenTarArchive(path));
    uint64_t entries = 0;
    size_t cached = 0;
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
      const bool top = name == "manifest.json" || name == "index.json" || name == "oci-layout";
      const la_int64_t size = archive_entry_size(e);
      if (top && m.regular && size > static_cast<la_int64_t>(kMaxManifestBytes)) {
        return absl::InvalidArgumentError(
            fmt::format("{}: {} is larger than {} bytes", path, name, kMaxManifestBytes));
      }
      const bool small_blob = m.regular && name.rfind("blobs/", 0) == 0 && size >= 0 &&
                              size <= static_cast<la_int64_t>(kMaxCachedBlobBytes) &&
                              cached + static_cast<size_t>(size) <= kMaxCachedBytes;
      if (m.regular && (top || small_blob) && contents.count(name) == 0) {
        BRAGG_ASSIGN_OR_RETURN(std::string data,
                               ReadMemberData(path, a.get(), entries, name,
                                              top ? kMaxManifestBytes : static_cast<size_t>(size)));
        cached += top ? 0 : data.size();
        contents[name] = std::move(data);
      }
      members[name] = std::move(m);
    }
  }
  std::vector<Wanted> wanted;
  std::string format;
  if (contents.count("manifest.json") != 0) {
    format = "docker-archive";
    BRAGG_ASSIGN_OR_RETURN(wanted, DockerLayers(path, members, contents["manifest.json"], ref));
  } else if (contents.count("index.json") != 0 && contents.count("oci-layout") != 0) {
    format = "oci-archive";
    nlohmann::json layout = nlohmann::json::parse(contents["oci-layout"], nullptr, false);
    if (layout.is_discarded() || JsonString(layout, "imageLayoutVersion").empty()) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: oci-layout is not an OCI layout marker ({{\"imageLayoutVersion\": ...}})", path));
    }
    BRAGG_ASSIGN_OR_RETURN(wanted, OciLayers(path, members, &contents, ref, max_bytes));
  } else {
    if (!ref.empty()) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: --ref {} given, but this is a root filesystem tarball (no manifest.json, no "
          "OCI index.json), which holds one image",
          path, ref));
    }
    return ImageLayers{.format = "rootfs", .layers = {path}};
  }
  BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> layers,
                         CopyLayers(path, wanted, scratch_dir, max_bytes));
  return ImageLayers{.format = format, .layers = std::move(layers)};
}

}  // namespace bragg::pbox
