#include "pbox/client/oci_dir_tar.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/fs.h"
#include "fmt/format.h"

namespace bragg::pbox::client {
namespace {

constexpr size_t kBlock = 512;

Status SendAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      return ErrnoError("send", "OCI layout tar stream");
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// A ustar header for a regular file `name` (< 100 bytes) of `size` bytes.
std::string Header(const std::string& name, uint64_t size) {
  std::string h(kBlock, '\0');
  std::memcpy(h.data(), name.data(), name.size());
  std::memcpy(h.data() + 100, "0000644", 7);
  std::memcpy(h.data() + 108, "0000000", 7);
  std::memcpy(h.data() + 116, "0000000", 7);
  if (size < (1ull << 33)) {
    std::string octal = fmt::format("{:011o}", size);
    std::memcpy(h.data() + 124, octal.data(), 11);
  } else {
    // GNU base-256: the top bit of the first byte set, the size big-endian in the rest.
    h[124] = static_cast<char>(0x80);
    for (int i = 0; i < 8; ++i) {
      h[135 - i] = static_cast<char>((size >> (8 * i)) & 0xff);
    }
  }
  std::memcpy(h.data() + 136, "00000000000", 11);  // mtime
  h[156] = '0';                                    // regular file
  std::memcpy(h.data() + 257, "ustar", 6);
  std::memcpy(h.data() + 263, "00", 2);
  std::memset(h.data() + 148, ' ', 8);
  unsigned sum = 0;
  for (unsigned char c : h) {
    sum += c;
  }
  std::string chk = fmt::format("{:06o}", sum);
  std::memcpy(h.data() + 148, chk.data(), 6);
  h[154] = '\0';
  h[155] = ' ';
  return h;
}

// Regular files under `dir`/blobs/<algorithm>/, as "blobs/<algorithm>/<name>", sorted.
Result<std::vector<std::string>> ListBlobs(const std::string& dir) {
  std::vector<std::string> out;
  DIR* top = ::opendir((dir + "/blobs").c_str());
  if (top == nullptr) {
    if (errno == ENOENT) {
      return out;
    }
    return ErrnoError("opendir", dir + "/blobs");
  }
  std::unique_ptr<DIR, int (*)(DIR*)> top_owner(top, ::closedir);
  while (struct dirent* alg = ::readdir(top)) {
    std::string a = alg->d_name;
    if (a == "." || a == ".." || alg->d_type != DT_DIR) {
      continue;
    }
    DIR* sub = ::opendir((dir + "/blobs/" + a).c_str());
    if (sub == nullptr) {
      return ErrnoError("opendir", dir + "/blobs/" + a);
    }
    std::unique_ptr<DIR, int (*)(DIR*)> sub_owner(sub, ::closedir);
    while (struct dirent* blob = ::readdir(sub)) {
      std::string name = "blobs/" + a + "/" + blob->d_name;
      if (blob->d_type == DT_REG && name.size() < 100) {
        out.push_back(std::move(name));
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

Result<std::unique_ptr<OciDirTar>> OciDirTar::Start(const std::string& dir) {
  for (const char* marker : {"oci-layout", "index.json"}) {
    struct stat st;
    if (::lstat((dir + "/" + marker).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      return absl::InvalidArgumentError(
          fmt::format("{} is a directory without {}: not an OCI image layout", dir, marker));
    }
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return ErrnoError("socketpair", "OCI layout tar stream");
  }
  std::unique_ptr<OciDirTar> t(new OciDirTar());
  t->read_end_.Reset(sv[0]);
  UniqueFd write_end(sv[1]);
  (void)::shutdown(sv[0], SHUT_WR);
  t->writer_ = std::thread(&OciDirTar::Write, t.get(), dir, std::move(write_end));
  return t;
}

void OciDirTar::Write(std::string dir, UniqueFd out) {
  auto run = [&]() -> Status {
    BRAGG_ASSIGN_OR_RETURN(std::vector<std::string> names, ListBlobs(dir));
    names.insert(names.begin(), {"oci-layout", "index.json"});
    std::vector<char> buf(1 << 20);
    for (const std::string& name : names) {
      BRAGG_ASSIGN_OR_RETURN(UniqueFd in, OpenFile(dir + "/" + name, O_RDONLY | O_NOFOLLOW));
      struct stat st;
      if (::fstat(in.get(), &st) != 0) {
        return ErrnoError("fstat", dir + "/" + name);
      }
      if (!S_ISREG(st.st_mode)) {
        continue;
      }
      const uint64_t size = static_cast<uint64_t>(st.st_size);
      const std::string header = Header(name, size);
      BRAGG_RETURN_IF_ERROR(SendAll(out.get(), header.data(), header.size()));
      uint64_t left = size;
      while (left > 0) {
        ssize_t n = ::read(in.get(), buf.data(), std::min<uint64_t>(left, buf.size()));
        if (n < 0 && errno == EINTR) {
          continue;
        }
        if (n < 0) {
          return ErrnoError("read", dir + "/" + name);
        }
        if (n == 0) {
          return absl::AbortedError(fmt::format("{}/{} shrank while it was being sent", dir, name));
        }
        BRAGG_RETURN_IF_ERROR(SendAll(out.get(), buf.data(), static_cast<size_t>(n)));
        left -= static_cast<uint64_t>(n);
      }
      const size_t pad = (kBlock - size % kBlock) % kBlock;
      std::string zeros(pad, '\0');
      BRAGG_RETURN_IF_ERROR(SendAll(out.get(), zeros.data(), zeros.size()));
    }
    std::string end(2 * kBlock, '\0');
    return SendAll(out.get(), end.data(), end.size());
  };
  status_ = run();
}

Status OciDirTar::Finish() {
  if (writer_.joinable()) {
    writer_.join();
  }
  return status_;
}

OciDirTar::~OciDirTar() {
  read_end_.Reset();
  if (writer_.joinable()) {
    writer_.join();
  }
}

}  // namespace bragg::pbox::client
