#pragma once

#include <dirent.h>
#include <unistd.h>

#include <memory>
#include <utility>

namespace bragg {

// Owns one file descriptor; closes it on destruction. Copy deleted, move transfers ownership.
// Not thread-safe: one owner at a time.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { Reset(); }

  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset(other.Release());
    }
    return *this;
  }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  explicit operator bool() const { return valid(); }

  // Gives up ownership without closing.
  [[nodiscard]] int Release() { return std::exchange(fd_, -1); }

  // Closes the current fd (if any) and takes `fd`.
  void Reset(int fd = -1) {
    if (fd_ >= 0) {
      ::close(fd_);
    }
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

// Owns an open directory stream (opendir/fdopendir); closedir on destruction. A stream made by
// fdopendir owns its fd from then on: release the UniqueFd it came from only once it succeeded.
struct DirCloser {
  void operator()(DIR* dir) const {
    if (dir != nullptr) {
      ::closedir(dir);
    }
  }
};
using UniqueDir = std::unique_ptr<DIR, DirCloser>;

// A pipe's two ends, both O_CLOEXEC.
struct Pipe {
  UniqueFd read;
  UniqueFd write;
};

}  // namespace bragg
