#include "pbox/init/init_helpers.h"

#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

namespace bragg::pbox {
namespace {

constexpr int kMaxOpenDirs = 32;

int RemoveEntry(const char* path, const struct stat* /*st*/, int type, struct FTW* /*ftw*/) {
  // Errors are not fatal: the agent removes what is left itself; what matters here is that
  // the sentry removes (and so forgets) everything it can.
  if (type == FTW_DP) {
    (void)rmdir(path);
  } else {
    (void)unlink(path);
  }
  return 0;
}

int Gone(const char* path) {
  struct stat st;
  if (lstat(path, &st) != 0 && errno == ENOENT) {
    return 0;
  }
  fprintf(stderr, "pbox-init: %s is still there\n", path);
  return 1;
}

}  // namespace

bool IsInitHelper(int argc, char** argv) {
  if (argc < 2) {
    return false;
  }
  return strcmp(argv[1], "--sync") == 0 || strcmp(argv[1], "--remove") == 0 ||
         strcmp(argv[1], "--remove-tree") == 0;
}

int RunInitHelper(int argc, char** argv) {
  if (argc == 2 && strcmp(argv[1], "--sync") == 0) {
    sync();
    return 0;
  }
  const bool tree = strcmp(argv[1], "--remove-tree") == 0;
  if (argc != 3 || argv[2][0] != '/' || (!tree && strcmp(argv[1], "--remove") != 0)) {
    fprintf(stderr, "usage: pbox-init --sync | --remove /PATH | --remove-tree /PATH\n");
    return 2;
  }
  const char* path = argv[2];
  struct stat st;
  if (lstat(path, &st) != 0) {
    fprintf(stderr, "pbox-init: %s: %s\n", path, strerror(errno));
    return 1;
  }
  if (!tree) {
    if (unlink(path) != 0 && (errno == EISDIR || errno == EPERM)) {
      (void)rmdir(path);
    }
    return Gone(path);
  }
  // FTW_PHYS: symlinks are removed, never followed; FTW_MOUNT: mounts below are left alone.
  struct statvfs fs;
  if (!S_ISDIR(st.st_mode)) {
    (void)unlink(path);
  } else if (statvfs(path, &fs) == 0 && (fs.f_flag & ST_RDONLY) != 0) {
    // A read-only tree (the image's /usr bind): nothing to remove, and no point in walking it.
  } else {
    (void)nftw(path, RemoveEntry, kMaxOpenDirs, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
  }
  return Gone(path);
}

}  // namespace bragg::pbox
