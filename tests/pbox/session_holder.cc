// Test helper: opens a session on an agent, creates N sandboxes in it, prints the session id
// and waits to be killed. Used to check that a client's death ends its sandboxes.
//
//   session_holder ENDPOINT N

#include <unistd.h>

#include <cstdlib>
#include <iostream>

#include "pbox/client/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: session_holder ENDPOINT N\n";
    return 2;
  }
  auto c = bragg::pbox::client::Client::Connect({.endpoint = argv[1]});
  if (!c.ok()) {
    return 1;
  }
  auto s = (*c)->OpenSession("session_holder");
  if (!s.ok()) {
    std::cerr << s.status() << "\n";
    return 1;
  }
  bragg::pbox::v1::SandboxSpec spec;
  spec.set_memory_bytes(32 << 20);
  for (int i = 0; i < std::atoi(argv[2]); ++i) {
    auto sb = (*c)->Create(spec, (*s)->id());
    if (!sb.ok()) {
      std::cerr << sb.status() << "\n";
      return 1;
    }
  }
  std::cout << (*s)->id() << std::endl;
  for (;;) {
    ::pause();
  }
}
