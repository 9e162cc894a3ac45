// An LD_PRELOAD library for test_rootless.py that makes pboxd see a kernel before 5.8 as an
// unprivileged user does: mount(2) refuses an OverlayFS with `userxattr` (EINVAL; Linux 5.11
// allowed it in a user namespace), and mknodat(2) refuses a 0/0 character device, the
// overlay's whiteout (EPERM; Linux 5.8 allowed it without CAP_MKNOD). Everything else goes to
// libc's. Resolved when it loads: pboxd's setup children share its memory and may not call
// dlsym.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>

typedef int (*mount_fn)(const char*, const char*, const char*, unsigned long, const void*);
typedef int (*mknodat_fn)(int, const char*, mode_t, dev_t);
static mount_fn real_mount;
static mknodat_fn real_mknodat;

__attribute__((constructor)) static void resolve(void) {
  real_mount = (mount_fn)dlsym(RTLD_NEXT, "mount");
  real_mknodat = (mknodat_fn)dlsym(RTLD_NEXT, "mknodat");
}

int mount(const char* source, const char* target, const char* type, unsigned long flags,
          const void* data) {
  if (type != NULL && strcmp(type, "overlay") == 0 && data != NULL &&
      strstr((const char*)data, "userxattr") != NULL) {
    errno = EINVAL;
    return -1;
  }
  return real_mount(source, target, type, flags, data);
}

int mknodat(int dirfd, const char* path, mode_t mode, dev_t dev) {
  if (S_ISCHR(mode) && dev == 0) {
    errno = EPERM;
    return -1;
  }
  return real_mknodat(dirfd, path, mode, dev);
}
