// pbox-init: PID 1 of every native sandbox. See init_server.h.
//
// Usage: pbox-init [--channel-fd=N]   (N defaults to 3)
//        pbox-init --stream [--isolate]
//            frames on stdin/stdout (the gVisor runtime); --isolate puts commands in a PID
//            namespace of their own and loads the seccomp program the agent sends ahead of
//            the frames (init_protocol.h, the program preamble; init_pid_namespace.h)
//        pbox-init --sync | --remove PATH | --remove-tree PATH
//            one-shot helpers for gVisor sandboxes (init_helpers.h)

#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/unique_fd.h"
#include "pbox/init/init_helpers.h"
#include "pbox/init/init_pid_namespace.h"
#include "pbox/init/init_server.h"

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
  bool isolate = false;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (i > 0 && std::strcmp(argv[i], "--isolate") == 0) {
      isolate = true;
    } else if (i > 0 && std::strncmp(argv[i], "--isolate=", 10) == 0) {
      fprintf(stderr, "pbox-init: --isolate takes no value: the program comes on stdin\n");
      return 2;
    } else {
      args.push_back(argv[i]);
    }
  }
  int channel_fd = 3;
  bool stream = false;
  std::string error;
  if (!bragg::pbox::ParseInitFlags(static_cast<int>(args.size()), args.data(), &channel_fd, &error,
                                   &stream)) {
    fprintf(stderr, "pbox-init: %s\n", error.c_str());
    return 2;
  }
  bragg::pbox::InitServerOptions options;
  if (isolate) {
    if (!stream) {
      fprintf(stderr, "pbox-init: --isolate needs --stream\n");
      return 2;
    }
    std::vector<sock_filter> filter;
    if (!bragg::pbox::ReadProgramPreamble(0, &filter, &error)) {
      fprintf(stderr, "pbox-init: cannot isolate commands: %s\n", error.c_str());
      return 1;
    }
    bragg::pbox::CommandNamespace ns;
    if (!bragg::pbox::EnterCommandNamespace(filter, &ns, &error)) {
      fprintf(stderr, "pbox-init: cannot isolate commands: %s\n", error.c_str());
      return 1;
    }
    options.proc_dir = std::move(ns.outer_proc);
    options.exit_with_pid = ns.holder;
  }
  auto server = stream ? bragg::pbox::InitServer::CreateStream(
                             bragg::UniqueFd(0), bragg::UniqueFd(1), std::move(options), &error)
                       : bragg::pbox::InitServer::Create(bragg::UniqueFd(channel_fd),
                                                         std::move(options), &error);
  if (server == nullptr) {
    fprintf(stderr, "pbox-init: %s\n", error.c_str());
    return 1;
  }
  if (stream) {
    // Under gVisor, stderr is runsc's log file on the host, and gVisor lets same-uid
    // commands open /proc/1/fd/2 despite PR_SET_DUMPABLE (unless --isolate hides pbox-init):
    // they could fill the host's disk through it. Once serving, nothing of pbox-init's goes
    // there; its start-up errors above still do (the agent reports that log's tail when a
    // sandbox does not start).
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
