#include "train/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "common/fs.h"
#include "common/str_cat.h"
#include "common/unique_fd.h"

namespace bragg::train {

namespace {

Status Errno(std::string_view what, const std::string& path) {
  return absl::InternalError(Cat(what, " ", path, ": ", std::strerror(errno)));
}

Status FsyncPath(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) {
    return Errno("open", path);
  }
  UniqueFd owned(fd);
  if (::fsync(owned.get()) != 0) {
    return Errno("fsync", path);
  }
  return absl::OkStatus();
}

}  // namespace

Status WriteSafetensors(const std::string& path, std::span<const TensorBytes> tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    header["__metadata__"] = metadata;
  }
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const TensorBytes& t : tensors) {
    if (!names.insert(t.name).second) {
      return absl::InvalidArgumentError(Cat(path, ": tensor ", t.name, " is given twice"));
    }
    uint64_t elements = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(Cat(path, ": tensor ", t.name, " has a negative dim"));
      }
      elements *= static_cast<uint64_t>(d);
    }
    if (elements * engine::TensorDTypeSize(t.dtype) != t.data.size()) {
      return absl::InvalidArgumentError(Cat(path, ": tensor ", t.name, " has ", t.data.size(),
                                            " bytes, its dtype and shape need ",
                                            elements * engine::TensorDTypeSize(t.dtype)));
    }
    header[t.name] = {{"dtype", std::string(engine::TensorDTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string h = header.dump();
  // The data starts 8-byte aligned, as safetensors' own writer pads the header with spaces.
  h.append((8 - h.size() % 8) % 8, ' ');
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC));
  uint64_t n = h.size();
  char len[8];
  for (int i = 0; i < 8; ++i) {
    len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  }
  BRAGG_RETURN_IF_ERROR(WriteAll(fd.get(), std::string_view(len, 8)));
  BRAGG_RETURN_IF_ERROR(WriteAll(fd.get(), h));
  for (const TensorBytes& t : tensors) {
    BRAGG_RETURN_IF_ERROR(WriteAll(
        fd.get(), std::string_view(reinterpret_cast<const char*>(t.data.data()), t.data.size())));
  }
  if (::fsync(fd.get()) != 0) {
    return Errno("fsync", path);
  }
  return absl::OkStatus();
}

Status PublishDirectory(const std::string& staging, const std::string& final_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(staging, ec)) {
    if (entry.is_regular_file()) {
      BRAGG_RETURN_IF_ERROR(FsyncPath(entry.path().string(), O_RDONLY));
    }
  }
  if (ec) {
    return absl::InternalError(Cat("listing ", staging, ": ", ec.message()));
  }
  BRAGG_RETURN_IF_ERROR(FsyncPath(staging, O_RDONLY | O_DIRECTORY));
  bool replace = fs::exists(final_dir);
  // An existing directory is swapped with the new one in one step (renameat2 RENAME_EXCHANGE),
  // so that no instant shows neither; the old one is then removed from the staging name.
  int rc =
      replace ? ::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE)
              : ::rename(staging.c_str(), final_dir.c_str());
  if (rc != 0) {
    return Errno(replace ? "renameat2(RENAME_EXCHANGE) onto" : "rename onto", final_dir);
  }
  std::string parent = fs::path(final_dir).parent_path().string();
  BRAGG_RETURN_IF_ERROR(FsyncPath(parent.empty() ? "." : parent, O_RDONLY | O_DIRECTORY));
  if (replace) {
    BRAGG_RETURN_IF_ERROR(RemoveTree(staging));
  }
  return absl::OkStatus();
}

}  // namespace bragg::train
