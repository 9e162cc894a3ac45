#pragma once

// One-shot helper commands of the pbox-init binary, run as ordinary commands inside gVisor
// sandboxes where the agent needs the sandbox's kernel (the sentry) to do a file operation
// itself rather than see it done behind its back on the host (gvisor_runtime.h):
//
//   pbox-init --sync               sync(2): the sentry writes back file data it caches.
//   pbox-init --remove PATH        unlink PATH (rmdir if it is a directory).
//   pbox-init --remove-tree PATH   remove PATH and everything below it, never following
//                                  symlinks nor crossing into other filesystems.
//
// They run with the rights of the sandbox's own commands, so they can do nothing a command
// could not. Exit status 0: done (for the removals: PATH was there and no longer is); 1: not
// done (the reason on stderr); 2: usage.

namespace bragg::pbox {

// True when argv names one of the helpers above (argv[1] is one of their flags).
bool IsInitHelper(int argc, char** argv);

// Runs the helper argv names and returns the process's exit status.
int RunInitHelper(int argc, char** argv);

}  // namespace bragg::pbox
