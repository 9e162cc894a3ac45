// pbox-init: PID 1 of every native sandbox. See init_server.h.
//
// Usage: pbox-init [--channel-fd=N]   (N defaults to 3)
//        pbox-init --stream            (frames on stdin/stdout; the gVisor runtime)

#include <cstdio>
#include <string>

#include "common/unique_fd.h"
#include "pbox/init_server.h"

int main(int argc, char** argv) {
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
  return server->Run();
}
