#include "common/fs.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

namespace bragg {
namespace {

TEST(FsTest, TempDirIsRemovedWithItsContents) {
  std::string path;
  {
    auto dir = TempDir::Create();
    ASSERT_TRUE(dir.ok()) << dir.status();
    path = dir->path();
    ASSERT_TRUE(MakeDirs(path + "/a/b/c").ok());
    ASSERT_TRUE(WriteStringToFile(path + "/a/b/c/f", "hello").ok());
    ASSERT_EQ(::symlink("/etc", (path + "/a/link").c_str()), 0);
    EXPECT_EQ(*ReadFileToString(path + "/a/b/c/f"), "hello");
  }
  struct stat st;
  EXPECT_NE(::lstat(path.c_str(), &st), 0);
  // The symlink was removed, not followed.
  EXPECT_EQ(::lstat("/etc/passwd", &st), 0);
}

TEST(FsTest, RemoveTreeMissingIsOk) { EXPECT_TRUE(RemoveTree("/nonexistent/bragg/x").ok()); }

TEST(FsTest, ReadMissingFileIsNotFound) {
  auto r = ReadFileToString("/nonexistent/bragg/x");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("/nonexistent/bragg/x"), std::string::npos);
}

TEST(FsTest, RemoveTreeRefusesToCrossMountPoints) {
  if (geteuid() != 0) {
    GTEST_SKIP() << "needs root to mount";
  }
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  ASSERT_TRUE(MakeDirs(dir->path() + "/m").ok());
  auto m = ScopedMount::Mount("tmpfs", dir->path() + "/m", "tmpfs", 0, "size=1m");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(WriteStringToFile(dir->path() + "/m/keep", "x").ok());
  Status s = RemoveTree(dir->path());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(ReadFileToString(dir->path() + "/m/keep").ok());
  ASSERT_TRUE(m->Unmount().ok());
  EXPECT_TRUE(RemoveTree(dir->path()).ok());
}

}  // namespace
}  // namespace bragg
