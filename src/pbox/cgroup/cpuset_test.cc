#include "pbox/cgroup/cpuset.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <thread>

namespace bragg::pbox {
namespace {

TEST(CpuSetTest, ParsesKernelFormat) {
  auto s = CpuSet::Parse("0-3,8,10-11\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->cpus(), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(s->ToString(), "0-3,8,10-11");
  EXPECT_EQ(s->size(), 7u);
}

TEST(CpuSetTest, EmptyAndWhitespace) {
  for (const char* text : {"", "\n", "  \t\n"}) {
    auto s = CpuSet::Parse(text);
    ASSERT_TRUE(s.ok()) << text;
    EXPECT_TRUE(s->empty());
    EXPECT_EQ(s->ToString(), "");
  }
  auto s = CpuSet::Parse(" 5 \n");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->ToString(), "5");
}

TEST(CpuSetTest, CanonicalizesOverlapsAndOrder) {
  auto s = CpuSet::Parse("7,0-2,1,3,2-4,65535");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->ToString(), "0-4,7,65535");
  EXPECT_EQ(CpuSet({5, 1, 1, 2}).ToString(), "1-2,5");
}

TEST(CpuSetTest, RejectsHostileInput) {
  for (const char* text : {"-1",
                           "1--2",
                           "3-1",
                           "a",
                           "1,,2",
                           ",1",
                           "1,",
                           "1-",
                           "-",
                           "0x1",
                           "65536",
                           "0-65536",
                           "99999999999999999999",
                           "1 2",
                           "1-2:1",
                           "+1",
                           "1\n2",
                           "\x01",
                           "0-3,8-7",
                           "1.5"}) {
    auto s = CpuSet::Parse(text);
    EXPECT_FALSE(s.ok()) << "accepted '" << text << "'";
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
  auto s = CpuSet::Parse("3-1");
  EXPECT_NE(std::string(s.status().message()).find("reversed"), std::string::npos);
  s = CpuSet::Parse("70000");
  EXPECT_NE(std::string(s.status().message()).find("65535"), std::string::npos);
}

// Found while fuzzing the parsers (tests/fuzz/parsers_fuzz.cc): every item was expanded
// before deduplication, so 160 KB of repeated full ranges made Parse allocate 5 GB of ints.
// Ranges are now merged before they are expanded (memory bounded by the CPU number range).
TEST(CpuSetTest, RepeatedFullRangesStayBounded) {
  std::string text = "0-65535";
  for (int i = 0; i < 20000; ++i) {
    text += ",0-65535";
  }
  auto s = CpuSet::Parse(text);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->size(), 65536u);
  EXPECT_EQ(s->ToString(), "0-65535");
  auto t = CpuSet::Parse("7,3-4,7,4");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->ToString(), "3-4,7");
}

TEST(CpuSetTest, SetOperations) {
  CpuSet a({0, 1, 2, 3});
  CpuSet b({1, 3});
  EXPECT_TRUE(b.IsSubsetOf(a));
  EXPECT_FALSE(a.IsSubsetOf(b));
  EXPECT_TRUE(CpuSet().IsSubsetOf(b));
  EXPECT_EQ(a.Minus(b).ToString(), "0,2");
  EXPECT_EQ(a.Last(2).ToString(), "2-3");
  EXPECT_EQ(a.Last(10), a);
  EXPECT_TRUE(a.Last(0).empty());
  EXPECT_TRUE(a.Contains(2));
  EXPECT_FALSE(a.Contains(4));
  EXPECT_FALSE(a.Contains(-1));
}

TEST(CpuSetTest, ForThisProcessMatchesAffinity) {
  auto s = CpuSet::ForThisProcess();
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_FALSE(s->empty());
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  EXPECT_EQ(s->size(), static_cast<size_t>(CPU_COUNT(&set)));
  for (int cpu : s->cpus()) {
    EXPECT_TRUE(CPU_ISSET(cpu, &set)) << cpu;
  }
  // Round trip through the text format.
  auto again = CpuSet::Parse(s->ToString());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *s);
}

TEST(CpuAllocatorTest, LeastLoadedSpreads) {
  CpuAllocator alloc(CpuSet({4, 5, 6, 7}));
  auto a = alloc.Allocate(2);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->ToString(), "4-5");
  auto b = alloc.Allocate(2);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ToString(), "6-7");
  auto c = alloc.Allocate(0);  // 0 means 1
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->size(), 1u);
  EXPECT_EQ(alloc.Load(), (std::vector<uint32_t>{2, 1, 1, 1}));
  alloc.Release(*a);
  EXPECT_EQ(alloc.Load(), (std::vector<uint32_t>{1, 0, 1, 1}));
  auto d = alloc.Allocate(1);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->ToString(), "5");
}

TEST(CpuAllocatorTest, WithinASessionsCpus) {
  CpuAllocator alloc(CpuSet({4, 5, 6, 7}));
  const CpuSet job({6, 7, 9});  // 9 is not in the pool: never handed out
  for (int i = 0; i < 6; ++i) {
    auto a = alloc.Allocate(1, &job);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_TRUE(a->IsSubsetOf(CpuSet({6, 7}))) << a->ToString();
  }
  EXPECT_EQ(alloc.Load(), (std::vector<uint32_t>{0, 0, 3, 3}));
  auto two = alloc.Allocate(2, &job);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->ToString(), "6-7");
  // More CPUs than the session's share of the pool, or a session outside the pool.
  auto r = alloc.Allocate(3, &job);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(r.status().message()).find("only 2"), std::string::npos);
  const CpuSet outside({0, 1});
  EXPECT_EQ(alloc.Allocate(1, &outside).status().code(), absl::StatusCode::kInvalidArgument);
  // Other sessions still spread over the whole pool, least loaded first.
  auto any = alloc.Allocate(2);
  ASSERT_TRUE(any.ok());
  EXPECT_EQ(any->ToString(), "4-5");
}

TEST(CpuAllocatorTest, OversubscribesEvenly) {
  CpuAllocator alloc(CpuSet({0, 1}));
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(alloc.Allocate(1).ok());
  }
  EXPECT_EQ(alloc.Load(), (std::vector<uint32_t>{50, 50}));
}

TEST(CpuAllocatorTest, RejectsBadRequestsAndForeignReleases) {
  CpuAllocator alloc(CpuSet({0, 1}));
  auto r = alloc.Allocate(3);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(r.status().message()).find("only 2"), std::string::npos);
  EXPECT_FALSE(alloc.Allocate(UINT32_MAX).ok());
  CpuAllocator empty{CpuSet()};
  EXPECT_FALSE(empty.Allocate(1).ok());
  // Releasing CPUs outside the pool, or more times than allocated, never underflows.
  alloc.Release(CpuSet({0, 1, 9}));
  EXPECT_EQ(alloc.Load(), (std::vector<uint32_t>{0, 0}));
  ASSERT_TRUE(alloc.Allocate(1).ok());
  alloc.Release(CpuSet({9}));
  EXPECT_EQ(alloc.Load(), (std::vector<uint32_t>{1, 0}));
}

TEST(CpuAllocatorTest, ConcurrentAllocateRelease) {
  CpuAllocator alloc(CpuSet({0, 1, 2, 3, 4, 5, 6, 7}));
  constexpr int kThreads = 8;
  constexpr int kIters = 2000;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<CpuSet> held;
      for (int i = 0; i < kIters; ++i) {
        auto s = alloc.Allocate(static_cast<uint32_t>(1 + (i + t) % 3));
        if (!s.ok()) {
          ++failures;
          continue;
        }
        held.push_back(*s);
        if (held.size() > 4) {
          alloc.Release(held.front());
          held.erase(held.begin());
        }
      }
      for (const CpuSet& s : held) {
        alloc.Release(s);
      }
    });
  }
  // Readers race the writers.
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(alloc.Load().size(), 8u);
  }
  for (auto& th : threads) {
    th.join();
  }
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(alloc.Load(), std::vector<uint32_t>(8, 0));
}

TEST(CpuAllocatorTest, ConcurrentAllocationsStayBalanced) {
  CpuAllocator alloc(CpuSet({0, 1, 2, 3}));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 250; ++i) {
        ASSERT_TRUE(alloc.Allocate(1).ok());
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  EXPECT_EQ(alloc.Load(), (std::vector<uint32_t>{250, 250, 250, 250}));
}

}  // namespace
}  // namespace bragg::pbox
