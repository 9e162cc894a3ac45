#include "gateway/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>

namespace bragg::gateway {
namespace {

std::vector<int32_t> Prompt(int shared, int unique_seed, int unique_len) {
  std::vector<int32_t> v;
  for (int i = 0; i < shared; ++i) {
    v.push_back(1000 + i);
  }
  for (int i = 0; i < unique_len; ++i) {
    v.push_back(unique_seed * 7919 + i);
  }
  return v;
}

std::unique_ptr<Router> MakeRouter(Policy p, int n) {
  RouterOptions o;
  o.policy = p;
  auto r = std::make_unique<Router>(o);
  for (int i = 0; i < n; ++i) {
    r->AddWorker("http://w" + std::to_string(i));
  }
  return r;
}

TEST(RouterTest, ParsePolicy) {
  EXPECT_EQ(*ParsePolicy("sticky"), Policy::kSticky);
  EXPECT_EQ(*ParsePolicy("cache_aware"), Policy::kCacheAware);
  EXPECT_EQ(*ParsePolicy("round_robin"), Policy::kRoundRobin);
  EXPECT_EQ(*ParsePolicy("least_load"), Policy::kLeastLoad);
  EXPECT_EQ(ParsePolicy("random").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParsePolicy("").ok());
  EXPECT_EQ(PolicyName(Policy::kCacheAware), "cache_aware");
}

TEST(RouterTest, NoHealthyWorkerIsUnavailable) {
  RouterOptions o;
  Router empty(o);
  EXPECT_EQ(empty.Route("k", Prompt(1, 1, 1)).status().code(), absl::StatusCode::kUnavailable);
  auto owned = MakeRouter(Policy::kRoundRobin, 1);
  Router& r = *owned;
  r.SetHealthy(0, false);
  EXPECT_EQ(r.Route("", Prompt(1, 1, 1)).status().code(), absl::StatusCode::kUnavailable);
  r.SetHealthy(7, false);  // out of range: ignored
}

TEST(RouterTest, AddWorkerIsIdempotent) {
  auto owned = MakeRouter(Policy::kRoundRobin, 2);
  Router& r = *owned;
  EXPECT_EQ(r.AddWorker("http://w1"), 1);
  EXPECT_EQ(r.num_workers(), 2u);
}

TEST(RouterTest, RoundRobinSkipsUnhealthy) {
  auto owned = MakeRouter(Policy::kRoundRobin, 3);
  Router& r = *owned;
  r.SetHealthy(1, false);
  std::vector<int> got;
  for (int i = 0; i < 4; ++i) {
    auto d = r.Route("", Prompt(0, i, 4));
    ASSERT_TRUE(d.ok());
    got.push_back(d->worker);
  }
  EXPECT_EQ(got, (std::vector<int>{0, 2, 0, 2}));
}

TEST(RouterTest, LeastLoadPicksFewestInFlight) {
  auto owned = MakeRouter(Policy::kLeastLoad, 3);
  Router& r = *owned;
  auto a = r.Route("", Prompt(0, 1, 4));
  auto b = r.Route("", Prompt(0, 2, 4));
  auto c = r.Route("", Prompt(0, 3, 4));
  std::set<int> distinct = {a->worker, b->worker, c->worker};
  EXPECT_EQ(distinct.size(), 3u);
  r.Finish(b->worker, 4, 0);
  EXPECT_EQ(r.Route("", Prompt(0, 4, 4))->worker, b->worker);
}

TEST(RouterTest, StickyKeepsRolloutOnItsWorker) {
  auto owned = MakeRouter(Policy::kSticky, 4);
  Router& r = *owned;
  std::map<std::string, int> home;
  for (int turn = 0; turn < 5; ++turn) {
    for (int k = 0; k < 20; ++k) {
      std::string key = "r" + std::to_string(k);
      auto d = r.Route(key, Prompt(100, k, 10 * (turn + 1)));
      ASSERT_TRUE(d.ok());
      r.Finish(d->worker, 0, 0);
      if (turn == 0) {
        home[key] = d->worker;
      } else {
        EXPECT_EQ(d->worker, home[key]) << key;
        EXPECT_EQ(d->reason, "sticky");
      }
    }
  }
  auto counts = r.DecisionCounts();
  EXPECT_EQ(counts["sticky"], 80u);
}

TEST(RouterTest, DeadWorkerRolloutsMoveOnce) {
  auto owned = MakeRouter(Policy::kSticky, 3);
  Router& r = *owned;
  std::map<std::string, int> home;
  for (int k = 0; k < 30; ++k) {
    std::string key = "r" + std::to_string(k);
    home[key] = r.Route(key, Prompt(10, k, 5))->worker;
  }
  r.SetHealthy(0, false);
  std::map<std::string, int> moved_to;
  for (int turn = 0; turn < 3; ++turn) {
    for (int k = 0; k < 30; ++k) {
      std::string key = "r" + std::to_string(k);
      auto d = r.Route(key, Prompt(10, k, 5 + turn));
      ASSERT_TRUE(d.ok());
      EXPECT_NE(d->worker, 0);
      if (home[key] != 0) {
        EXPECT_EQ(d->worker, home[key]);
        EXPECT_FALSE(d->moved);
      } else if (turn == 0) {
        EXPECT_TRUE(d->moved);
        EXPECT_EQ(d->reason, "failover");
        moved_to[key] = d->worker;
      } else {
        EXPECT_FALSE(d->moved) << "moved twice: " << key;
        EXPECT_EQ(d->worker, moved_to[key]);
      }
    }
    if (turn == 0) {
      r.SetHealthy(0, true);  // back, cold: the moved rollouts stay where they went
    }
  }
  EXPECT_FALSE(moved_to.empty());
  auto snap = r.Snapshot();
  EXPECT_EQ(snap[0].moved_out, moved_to.size());
  EXPECT_EQ(snap[0].rollouts, 0);
}

// Every rollout shares one long system prompt: the match is equal everywhere, so load decides.
double MaxMinRollouts(Policy p) {
  auto owned = MakeRouter(p, 8);
  Router& r = *owned;
  for (int k = 0; k < 400; ++k) {
    auto d = r.Route("r" + std::to_string(k), Prompt(2000, k, 50));
    // Sticky balances live rollouts; the others see requests in flight, so keep them there.
    if (p == Policy::kSticky) {
      r.Finish(d->worker, 0, 0);
    }
  }
  auto snap = r.Snapshot();
  uint64_t mx = 0;
  uint64_t mn = UINT64_MAX;
  for (const auto& s : snap) {
    mx = std::max(mx, s.requests);
    mn = std::min(mn, s.requests);
  }
  return mn == 0 ? 1e9 : static_cast<double>(mx) / static_cast<double>(mn);
}

TEST(RouterTest, SharedSystemPromptDoesNotPileUp) {
  EXPECT_LE(MaxMinRollouts(Policy::kSticky), 1.5);
  EXPECT_LE(MaxMinRollouts(Policy::kCacheAware), 1.5);
  // sgl-router's rules send every rollout to the best match until the load gap passes 64.
  EXPECT_GT(MaxMinRollouts(Policy::kSglCacheAware), 1.5);
}

TEST(RouterTest, CacheAwareFollowsTheLongestPrefix) {
  auto owned = MakeRouter(Policy::kCacheAware, 4);
  Router& r = *owned;
  std::map<int, int> home;
  for (int k = 0; k < 8; ++k) {
    auto d = r.Route("", Prompt(500, k, 100));
    r.Finish(d->worker, 0, 0);
    home[k] = d->worker;
  }
  for (int k = 0; k < 8; ++k) {
    auto d = r.Route("", Prompt(500, k, 300));
    r.Finish(d->worker, 0, 0);
    EXPECT_EQ(d->worker, home[k]);
    EXPECT_EQ(d->expected_cached, 600u);
  }
}

TEST(RouterTest, NewRolloutsAfterVersionChangeGetANewSalt) {
  auto owned = MakeRouter(Policy::kSticky, 2);
  Router& r = *owned;
  auto old_turn = r.Route("old", Prompt(10, 1, 5));
  EXPECT_EQ(old_turn->salt, "");
  r.SetFleetVersion("7");
  auto old_next = r.Route("old", Prompt(10, 1, 9));
  EXPECT_EQ(old_next->salt, "");  // keeps the KV it has
  auto fresh = r.Route("new", Prompt(10, 1, 5));
  EXPECT_EQ(fresh->salt, "wv:7");
  // The fresh rollout does not count the old-version prefix as cached.
  EXPECT_EQ(fresh->expected_cached, 0u);
  // A client's own extra_key is combined with the version salt, never replaces it.
  auto client = r.Route("mine", Prompt(10, 1, 5), "custom");
  EXPECT_EQ(client->salt, "custom|wv:7");
  EXPECT_EQ(client->expected_cached, 0u);
  auto client_old = r.Route("old", Prompt(10, 1, 9), "custom");
  EXPECT_EQ(client_old->salt, "custom");  // the old rollout had no version salt
  EXPECT_NE(SaltToken("a"), SaltToken("b"));
  EXPECT_LT(SaltToken("a"), 0);
}

TEST(RouterTest, OnlyStickyRolloutsCountAsMoved) {
  for (Policy p : {Policy::kRoundRobin, Policy::kLeastLoad, Policy::kCacheAware}) {
    auto owned = MakeRouter(p, 3);
    Router& r = *owned;
    for (int turn = 0; turn < 6; ++turn) {
      auto d = r.Route("k", Prompt(5, turn, 5));
      ASSERT_TRUE(d.ok());
      EXPECT_FALSE(d->moved);
      r.Finish(d->worker, 0, 0);
    }
    int64_t rollouts = 0;
    for (const WorkerSnapshot& s : r.Snapshot()) {
      EXPECT_EQ(s.moved_out, 0u) << PolicyName(p);
      rollouts += s.rollouts;
    }
    EXPECT_EQ(rollouts, 1) << PolicyName(p);
  }
}

TEST(RouterTest, WorkerAddedUnhealthyGetsNothingUntilAdmitted) {
  auto owned = MakeRouter(Policy::kRoundRobin, 0);
  Router& r = *owned;
  EXPECT_EQ(r.AddWorker("http://late", false), 0);
  EXPECT_FALSE(r.Snapshot()[0].healthy);
  EXPECT_EQ(r.Route("", Prompt(1, 1, 1)).status().code(), absl::StatusCode::kUnavailable);
  r.SetHealthy(0, true);
  EXPECT_EQ(r.Route("", Prompt(1, 1, 1))->worker, 0);
}

TEST(RouterTest, ForgetReleasesRolloutSlot) {
  auto owned = MakeRouter(Policy::kSticky, 2);
  Router& r = *owned;
  auto d = r.Route("x", Prompt(1, 1, 1));
  EXPECT_EQ(r.Snapshot()[d->worker].rollouts, 1);
  r.Forget("x");
  r.Forget("never-seen");
  EXPECT_EQ(r.Snapshot()[d->worker].rollouts, 0);
}

}  // namespace
}  // namespace bragg::gateway
