// The image's read-only binds: read-only with every mount beneath them.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <sys/mount.h>

namespace bragg::pbox {

// Makes the mount at `target` and every mount beneath it read-only, nosuid and nodev
// (mount_setattr with AT_RECURSIVE, Linux 5.12). A remount with MS_RDONLY changes the top
// mount only: what the host has mounted beneath a bind's source (an NFS /usr/local under
// /usr, say) would stay writable to the sandbox's root and to the agent's file API. Returns 0
// or an errno; ENOSYS on an older kernel, where the caller binds without MS_REC instead.
// System calls only: safe in a vfork child.
inline int SetTreeReadOnly(const char* target) {
  struct mount_attr attr = {};
  attr.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
  return ::mount_setattr(AT_FDCWD, target, AT_RECURSIVE, &attr, sizeof(attr)) == 0 ? 0 : errno;
}

}  // namespace bragg::pbox
