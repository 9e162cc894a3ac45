#include "common/http_server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace bragg {
namespace {

// A stop right after the start must end the serving thread: httplib's stop() does nothing
// until the accept loop runs, so without the wait the join below would hang for good.
TEST(ServeInBackground, AStopRightAfterTheStartEndsTheThread) {
  for (int i = 0; i < 50; ++i) {
    httplib::Server server;
    auto port = BindServer(server, "127.0.0.1", 0);
    ASSERT_TRUE(port.ok()) << port.status();
    auto thread = ServeInBackground(server);
    ASSERT_TRUE(thread.ok()) << thread.status();
    server.stop();
    thread->join();
  }
}

TEST(ServeInBackground, ServesUntilStopped) {
  httplib::Server server;
  server.new_task_queue = [] { return new ElasticTaskQueue(8); };
  std::atomic<int> hits{0};
  server.Get("/x", [&](const httplib::Request&, httplib::Response& res) {
    ++hits;
    res.set_content("ok", "text/plain");
  });
  auto port = BindServer(server, "127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  auto thread = ServeInBackground(server);
  ASSERT_TRUE(thread.ok()) << thread.status();
  std::vector<std::thread> clients;
  for (int c = 0; c < 8; ++c) {
    clients.emplace_back([&] {
      httplib::Client client("127.0.0.1", *port);
      for (int i = 0; i < 20; ++i) {
        auto r = client.Get("/x");
        EXPECT_TRUE(r && r->status == 200 && r->body == "ok");
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(hits.load(), 160);
  server.stop();
  thread->join();
  httplib::Client after("127.0.0.1", *port);
  after.set_connection_timeout(1, 0);
  EXPECT_FALSE(after.Get("/x"));  // nothing listens any more
}

TEST(BindServer, APortInUseIsRefused) {
  httplib::Server first;
  auto port = BindServer(first, "127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  httplib::Server second;
  auto again = BindServer(second, "127.0.0.1", *port);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace bragg
