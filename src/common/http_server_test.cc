#include "common/http_server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <system_error>
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

// Starts threads until `allowed` have started, then throws as std::thread does when the kernel
// refuses one (EAGAIN: pid_max, threads-max, a pids cgroup).
ElasticTaskQueue::ThreadStarter RefusingAfter(std::atomic<int>& allowed,
                                              std::atomic<int>& started) {
  return [&](std::function<void()> fn) {
    if (allowed.fetch_sub(1) <= 0) {
      allowed.fetch_add(1);
      throw std::system_error(EAGAIN, std::generic_category(), "thread");
    }
    ++started;
    return std::thread(std::move(fn));
  };
}

TEST(ElasticTaskQueue, AThreadTheKernelRefusesLeavesTheJobQueuedNotLost) {
  std::atomic<int> allowed{2}, started{0}, done{0};
  std::atomic<bool> release{false};
  ElasticTaskQueue queue(64, RefusingAfter(allowed, started));
  for (int i = 0; i < 5; ++i) {
    queue.enqueue([&] {
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ++done;
    });
  }
  EXPECT_EQ(started.load(), 2);  // the other three wait for these two
  release = true;
  for (int i = 0; i < 5000 && done < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(done.load(), 5);
  // Threads start again once the kernel allows them.
  allowed = 1;
  release = false;
  for (int i = 0; i < 3; ++i) {
    queue.enqueue([&] {
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ++done;
    });
  }
  EXPECT_EQ(started.load(), 3);
  release = true;
  queue.shutdown();
  EXPECT_EQ(done.load(), 8);
}

// The server's accept loop calls enqueue: a refused thread used to escape it and end the
// process. With one thread allowed, connections are served one after another.
TEST(ElasticTaskQueue, AServerOutOfThreadsKeepsServing) {
  std::atomic<int> allowed{1}, started{0};
  httplib::Server server;
  server.new_task_queue = [&] { return new ElasticTaskQueue(64, RefusingAfter(allowed, started)); };
  server.set_keep_alive_max_count(1);  // each connection ends after one request
  server.Get("/x", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  auto port = BindServer(server, "127.0.0.1", 0);
  ASSERT_TRUE(port.ok()) << port.status();
  auto thread = ServeInBackground(server);
  ASSERT_TRUE(thread.ok()) << thread.status();
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&] {
      for (int i = 0; i < 5; ++i) {
        httplib::Client client("127.0.0.1", *port);
        client.set_keep_alive(false);
        auto r = client.Get("/x");
        if (r && r->status == 200 && r->body == "ok") ++ok;
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), 20);
  EXPECT_EQ(started.load(), 1);
  server.stop();
  thread->join();
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
