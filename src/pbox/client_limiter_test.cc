#include "pbox/client_limiter.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

namespace bragg::pbox {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

// A clock the test moves by hand, and a sleep that records instead of sleeping.
struct FakeTime {
  ClientLimiter::Clock::time_point now{};
  std::vector<microseconds> slept;
  std::function<ClientLimiter::Clock::time_point()> clock() {
    return [this] { return now; };
  }
  std::function<void(microseconds)> sleeper() {
    return [this](microseconds d) {
      slept.push_back(d);
      now += d;
    };
  }
};

TEST(ClientLimiterTest, CapsInFlightCallsPerClientAndKind) {
  FakeTime t;
  ClientLimiter lim({.max_creates = 2, .max_execs = 3}, t.clock(), t.sleeper());
  std::vector<ClientLimiter::Slot> held;
  for (int i = 0; i < 2; ++i) {
    auto s = lim.Admit("a", ClientLimiter::Kind::kCreate);
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(std::move(*s));
  }
  auto over = lim.Admit("a", ClientLimiter::Kind::kCreate);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find("--client-max-creates"), std::string_view::npos);
  // Another client, and another kind of call of the same client, are not affected.
  EXPECT_TRUE(lim.Admit("b", ClientLimiter::Kind::kCreate).ok());
  for (int i = 0; i < 3; ++i) {
    auto s = lim.Admit("a", ClientLimiter::Kind::kExec);
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(std::move(*s));
  }
  auto exec_over = lim.Admit("a", ClientLimiter::Kind::kExec);
  ASSERT_FALSE(exec_over.ok());
  EXPECT_NE(exec_over.status().message().find("--client-max-execs"), std::string_view::npos);
  // A finished call frees its place.
  held.erase(held.begin());
  EXPECT_TRUE(lim.Admit("a", ClientLimiter::Kind::kCreate).ok());
}

TEST(ClientLimiterTest, ZeroMeansNoCap) {
  ClientLimiter lim({.max_creates = 0, .max_execs = 0});
  std::vector<ClientLimiter::Slot> held;
  for (int i = 0; i < 5000; ++i) {
    auto s = lim.Admit("a", i % 2 ? ClientLimiter::Kind::kCreate : ClientLimiter::Kind::kExec);
    ASSERT_TRUE(s.ok());
    held.push_back(std::move(*s));
  }
}

TEST(ClientLimiterTest, SlotMovesReleaseOnce) {
  ClientLimiter lim({.max_creates = 1});
  auto s = lim.Admit("a", ClientLimiter::Kind::kCreate);
  ASSERT_TRUE(s.ok());
  ClientLimiter::Slot moved = std::move(*s);
  ClientLimiter::Slot assigned;
  assigned = std::move(moved);
  EXPECT_FALSE(lim.Admit("a", ClientLimiter::Kind::kCreate).ok());
  assigned = ClientLimiter::Slot();
  auto again = lim.Admit("a", ClientLimiter::Kind::kCreate);
  EXPECT_TRUE(again.ok());
}

TEST(ClientLimiterTest, RefusalsWithinTheBurstAreNotHeld) {
  FakeTime t;
  ClientLimiter lim({.refusals_per_second = 10, .refusal_hold_ms = 200}, t.clock(), t.sleeper());
  for (int i = 0; i < 10; ++i) {
    EXPECT_EQ(lim.RefusalDelay("a"), microseconds(0)) << i;
  }
  // The 11th within the same instant owes 1/10 s, the 12th 2/10 s, then the hold caps it.
  EXPECT_EQ(lim.RefusalDelay("a"), milliseconds(100));
  EXPECT_EQ(lim.RefusalDelay("a"), milliseconds(200));
  EXPECT_EQ(lim.RefusalDelay("a"), milliseconds(200));
  // Another client has its own budget.
  EXPECT_EQ(lim.RefusalDelay("b"), microseconds(0));
  // The budget refills at the rate: after the debt is paid and one more token is earned, the
  // next refusal is answered at once.
  t.now += milliseconds(300);
  EXPECT_EQ(lim.RefusalDelay("a"), microseconds(0));
}

TEST(ClientLimiterTest, PaceRefusalHoldsAndForgetsIdleClients) {
  FakeTime t;
  ClientLimiter lim({.refusals_per_second = 2, .refusal_hold_ms = 1000}, t.clock(), t.sleeper());
  lim.PaceRefusal("a");
  lim.PaceRefusal("a");
  EXPECT_TRUE(t.slept.empty());
  lim.PaceRefusal("a");  // owes half a second
  ASSERT_EQ(t.slept.size(), 1u);
  EXPECT_EQ(t.slept[0], milliseconds(500));
  // Once its budget is full again, the client is forgotten.
  t.now += std::chrono::seconds(5);
  (void)lim.Admit("a", ClientLimiter::Kind::kCreate);  // admitted and released at once
  EXPECT_EQ(lim.tracked_clients(), 0u);
}

TEST(ClientLimiterTest, HeldRefusalsPerClientAreBounded) {
  std::atomic<int> sleeping{0};
  std::atomic<bool> release{false};
  ClientLimiter lim(
      {.refusals_per_second = 1, .refusal_hold_ms = 60000, .max_held_refusals = 3},
      [] { return ClientLimiter::Clock::time_point{}; },
      [&](microseconds) {
        ++sleeping;
        while (!release) {
          std::this_thread::sleep_for(milliseconds(1));
        }
      });
  EXPECT_EQ(lim.RefusalDelay("a"), microseconds(0));  // the burst of one
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&] { lim.PaceRefusal("a"); });
  }
  for (int i = 0; i < 10000 && sleeping < 3; ++i) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_EQ(sleeping, 3);
  // Three are held: the next is answered at once.
  EXPECT_EQ(lim.RefusalDelay("a"), microseconds(0));
  release = true;
  for (auto& th : threads) {
    th.join();
  }
}

TEST(ClientLimiterTest, NoPacingWhenRateIsZero) {
  FakeTime t;
  ClientLimiter lim({.refusals_per_second = 0}, t.clock(), t.sleeper());
  for (int i = 0; i < 1000; ++i) {
    lim.PaceRefusal("a");
  }
  EXPECT_TRUE(t.slept.empty());
  EXPECT_EQ(lim.tracked_clients(), 0u);
}

TEST(ClientLimiterTest, NonsenseRatesMeanNoPacing) {
  for (double rate : {-5.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    FakeTime t;
    ClientLimiter lim({.refusals_per_second = rate}, t.clock(), t.sleeper());
    for (int i = 0; i < 100; ++i) {
      EXPECT_EQ(lim.RefusalDelay("a"), microseconds(0));
    }
    EXPECT_EQ(lim.limits().refusals_per_second, 0);
  }
}

TEST(ClientLimiterTest, ManyDistinctClientsDoNotGrowWithoutBound) {
  FakeTime t;
  ClientLimiter lim({.refusals_per_second = 5}, t.clock(), t.sleeper());
  for (int i = 0; i < 20000; ++i) {
    (void)lim.RefusalDelay("forged-" + std::to_string(i));
    t.now += milliseconds(1);
  }
  // Each forged id stays only until its one-token debt is refilled (a fifth of a second).
  EXPECT_LE(lim.tracked_clients(), 1100u);
}

TEST(ClientLimiterTest, ClientKey) {
  EXPECT_EQ(ClientKey("abc", "unix:"), "id:abc");
  EXPECT_EQ(ClientKey("", "ipv4:127.0.0.1:5000"), "peer:ipv4:127.0.0.1:5000");
  EXPECT_EQ(ClientKey(std::string(1000, 'x'), "unix:").size(), 3u + 128u);
}

}  // namespace
}  // namespace bragg::pbox
