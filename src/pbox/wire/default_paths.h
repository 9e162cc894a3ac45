#pragma once

// Where an agent listens and keeps its state when given no --listen / --state-dir, and where a
// client looks for it when given no endpoint: the one rule both sides follow.
//
//   root                 /run/pbox (pbox.sock, state/)
//   any other user       $XDG_RUNTIME_DIR/pbox when XDG_RUNTIME_DIR is an absolute path,
//                        else /tmp/pbox-<uid> (a rootless agent, docs/security.md)
//
// A client of another user tries the system agent's socket first, then its own.

#include <sys/types.h>

#include <string>

namespace bragg::pbox {

inline constexpr const char* kSystemRunDir = "/run/pbox";

// The run directory for a process of effective uid `euid`, with $XDG_RUNTIME_DIR `xdg`.
std::string DefaultRunDir(uid_t euid, const std::string& xdg);
// DefaultRunDir for this process.
std::string DefaultRunDir();
// "unix://<run dir>/pbox.sock" for a client of this process's euid: the system agent's when
// that socket exists (or the caller is root), else the caller's own.
std::string DefaultEndpoint();

}  // namespace bragg::pbox
