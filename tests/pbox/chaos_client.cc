// Test helper for the client-kill chaos test (tests/pbox/chaos): opens a session, prints its
// id, then loops create -> run -> upload -> exec -> (every other round) destroy, forever,
// until it is SIGKILLed at a random point. Whatever it was doing, its session's sandboxes
// must go with it.
//
//   chaos_client ENDPOINT

#include <unistd.h>

#include <iostream>
#include <string>

#include "pbox/client/client.h"

namespace v1 = bragg::pbox::v1;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: chaos_client ENDPOINT\n";
    return 2;
  }
  auto c = bragg::pbox::client::Client::Connect({.endpoint = argv[1]});
  if (!c.ok()) {
    std::cerr << c.status() << "\n";
    return 1;
  }
  auto s = (*c)->OpenSession("chaos_client");
  if (!s.ok()) {
    std::cerr << s.status() << "\n";
    return 1;
  }
  std::cout << (*s)->id() << std::endl;
  v1::SandboxSpec spec;
  spec.set_memory_bytes(64 << 20);
  spec.set_disk_bytes(16 << 20);
  const std::string payload(256 << 10, 'x');
  for (int round = 0;; ++round) {
    auto sb = (*c)->Create(spec, (*s)->id());
    if (!sb.ok()) {
      std::cerr << "create: " << sb.status() << "\n";
      return 1;
    }
    auto run = (*c)->Run({.sandbox_id = sb->id(), .argv = {"sh", "-c", "echo hi; sleep 0.005"}});
    if (!run.ok()) {
      std::cerr << "run: " << run.status() << "\n";
      return 1;
    }
    auto up = (*c)->WriteFile(sb->id(), "/tmp/upload", payload);
    if (!up.ok()) {
      std::cerr << "upload: " << up.status() << "\n";
      return 1;
    }
    v1::ExecStart start;
    start.set_sandbox_id(sb->id());
    start.add_argv("cat");
    start.add_argv("/tmp/upload");
    auto ex = (*c)->Exec(start, -1, [](bool, std::string_view) {});
    if (!ex.ok()) {
      std::cerr << "exec: " << ex.status() << "\n";
      return 1;
    }
    if (round % 2 == 0) {
      if (auto st = (*c)->Destroy(sb->id()); !st.ok()) {
        std::cerr << "destroy: " << st << "\n";
        return 1;
      }
    }
  }
}
