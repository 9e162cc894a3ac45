// pbox-init: PID 1 of every native sandbox. See init_server.h.
//
// Usage: pbox-init [--channel-fd=N]   (N defaults to 3)
//        pbox-init --stream            (frames on stdin/stdout; the gVisor runtime)
//        pbox-init --sync | --remove PATH | --remove-tree PATH
//                                      (one-shot helpers for gVisor sandboxes: init_helpers.h)

#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "common/unique_fd.h"
#include "pbox/init_helpers.h"
#include "pbox/init_server.h"

int main(int argc, char** argv) {
  if (bragg::pbox::IsInitHelper(argc, argv)) {
    return bragg::pbox::RunInitHelper(argc, argv);
  }
  // Commands in the sandbox run as the same uid (0, without capabilities) as PID 1. While
  // PID 1 is dumpable they could ptrace it, read its memory, or open through /proc/1/fd and
  // /proc/1/exe what it holds: the agent's log on stderr and the host's pbox-init binary.
  // Not dumpable, /proc/1 answers only to CAP_SYS_PTRACE, which no sandbox process has.
  // Commands are dumpable again after their exec.
  if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    fprintf(stderr, "pbox-init: prctl(PR_SET_DUMPABLE): %s\n", strerror(errno));
    return 1;
  }
  int channel_fd = 3;
  bool stream = false;
  std::string error;
  if (!bragg::pbox::ParseInitFlags(argc, argv, &channel_fd, &error, &stream)) {
    fprintf(stderr, "pbox-init: %s\n", error.c_str());
    return 2;
  }
  auto server =
      stream ? bragg::pbox::InitServer::CreateStream(bragg::UniqueFd(0), bragg::UniqueFd(1),
                                                     bragg::pbox::InitServerOptions{}, &error)
             : bragg::pbox::InitServer::Create(bragg::UniqueFd(channel_fd),
                                               bragg::pbox::InitServerOptions{}, &error);
  if (server == nullptr) {
    fprintf(stderr, "pbox-init: %s\n", error.c_str());
    return 1;
  }
  if (stream) {
    // Under gVisor, stderr is runsc's log file on the host, and gVisor lets same-uid
    // commands open /proc/1/fd/2 despite PR_SET_DUMPABLE: they could fill the host's disk
    // through it. Once serving, nothing of pbox-init's goes there; its start-up errors above
    // still do (the agent reports that log's tail when a sandbox does not start).
    bragg::UniqueFd null_fd(open("/dev/null", O_WRONLY | O_CLOEXEC));
    if (!null_fd.valid()) {
      fprintf(stderr, "pbox-init: cannot open /dev/null: %s\n", strerror(errno));
      return 1;
    }
    if (null_fd.get() == 2) {
      // fd 2 was closed, so open() took it: it stays as stderr (commands get their own).
      (void)null_fd.Release();
    } else if (dup2(null_fd.get(), 2) != 2) {
      fprintf(stderr, "pbox-init: cannot put /dev/null on stderr: %s\n", strerror(errno));
      return 1;
    }
  }
  return server->Run();
}
