#include "common/process.h"

#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include "common/fs.h"

namespace bragg {
namespace {

TEST(ProcessTest, ExitCodeAndOutput) {
  auto pipe = MakePipe();
  ASSERT_TRUE(pipe.ok());
  SpawnOptions opts;
  opts.stdout_fd = pipe->write.get();
  auto child = Spawn({"sh", "-c", "echo hi; exit 3"}, opts);
  ASSERT_TRUE(child.ok()) << child.status();
  pipe->write.Reset();
  auto info = child->Wait();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->exit_code, 3);
  EXPECT_EQ(info->signal, 0);
  char buf[16] = {};
  EXPECT_EQ(::read(pipe->read.get(), buf, sizeof(buf)), 3);
  EXPECT_STREQ(buf, "hi\n");
}

TEST(ProcessTest, WaitTimesOutThenSignal) {
  auto child = Spawn({"sleep", "100"});
  ASSERT_TRUE(child.ok());
  auto r = child->Wait(std::chrono::milliseconds(50));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(child->Signal(SIGTERM).ok());
  auto info = child->Wait();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->signal, SIGTERM);
  EXPECT_EQ(DescribeExit(*info).rfind("killed by signal 15", 0), 0u);
}

TEST(ProcessTest, DestructorKillsAndReaps) {
  pid_t pid;
  {
    auto child = Spawn({"sleep", "100"});
    ASSERT_TRUE(child.ok());
    pid = child->pid();
  }
  EXPECT_NE(::kill(pid, 0), 0);
}

TEST(ProcessTest, MissingProgramIsAnError) {
  auto child = Spawn({"/nonexistent/bragg-no-such-program"});
  EXPECT_FALSE(child.ok());
}

TEST(ProcessTest, SpawnSharingMemoryRunsOnOurMemoryAndReturnsOnceTheChildIsDone) {
  // The child writes into our memory and exits; CLONE_VFORK returns only after that, so the
  // write is there to read at once.
  static int seen = 0;
  seen = 0;
  auto child = SpawnSharingMemory(
      [](void* arg) -> int {
        *static_cast<int*>(arg) = 42;
        _exit(7);
      },
      &seen, 0, 64 << 10, "the test child");
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(seen, 42);
  auto info = child->Wait();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->exit_code, 7);
  // Flags the kernel refuses: an error that names the child, and no child.
  auto bad = SpawnSharingMemory([](void*) -> int { _exit(0); }, nullptr,
                                CLONE_THREAD /* without CLONE_SIGHAND: EINVAL */, 64 << 10,
                                "the refused child");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("the refused child"), std::string::npos)
      << bad.status();
}

}  // namespace
}  // namespace bragg
