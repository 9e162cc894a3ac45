// CopyLayerTree and FrozenLayer on the host filesystem: what a copy keeps (types, modes,
// owners, mtimes, xattrs including trusted.overlay.*, whiteouts, hard links), what it refuses
// (device nodes, trees too deep), that it never follows a link out of the tree, and that a
// layer leaves the disk with its last reference.

#include "pbox/image/frozen_layer.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <string>

#include "common/fs.h"

namespace bragg::pbox {
namespace {

class FrozenLayerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "needs root (mknod, chown, trusted.* xattrs)";
    }
    auto tmp = TempDir::Create("/tmp", "pbox-frozen-");
    ASSERT_TRUE(tmp.ok()) << tmp.status();
    tmp_ = std::move(*tmp);
    src_ = tmp_.path() + "/src";
    dst_ = tmp_.path() + "/dst";
    ASSERT_EQ(::mkdir(src_.c_str(), 0755), 0);
  }

  void Put(const std::string& rel, const std::string& data, mode_t mode = 0644) {
    ASSERT_TRUE(WriteStringToFile(src_ + "/" + rel, data).ok()) << rel;
    ASSERT_EQ(::chmod((src_ + "/" + rel).c_str(), mode), 0) << rel;
  }

  Status Copy() {
    auto fd = OpenFile(src_, O_RDONLY | O_DIRECTORY);
    if (!fd.ok()) {
      return fd.status();
    }
    return CopyLayerTree(fd->get(), dst_);
  }

  std::string Xattr(const std::string& path, const char* name) {
    char buf[256];
    ssize_t n = ::lgetxattr(path.c_str(), name, buf, sizeof(buf));
    return n < 0 ? "<none>" : std::string(buf, static_cast<size_t>(n));
  }

  TempDir tmp_;
  std::string src_, dst_;
};

TEST_F(FrozenLayerTest, CopyKeepsWhatOverlayNeeds) {
  Put("file", "data", 04750);
  ASSERT_EQ(::chown((src_ + "/file").c_str(), 1234, 5678), 0);
  ASSERT_EQ(::chmod((src_ + "/file").c_str(), 04750), 0);  // chown cleared the setuid bit
  struct timespec times[2] = {{1000, 0}, {1700000000, 123456789}};
  ASSERT_EQ(::utimensat(AT_FDCWD, (src_ + "/file").c_str(), times, 0), 0);
  ASSERT_EQ(::setxattr((src_ + "/file").c_str(), "user.k", "v", 1, 0), 0);
  ASSERT_EQ(::mkdir((src_ + "/opaque").c_str(), 0710), 0);
  ASSERT_EQ(::setxattr((src_ + "/opaque").c_str(), "trusted.overlay.opaque", "y", 1, 0), 0);
  Put("opaque/inner", "i");
  ASSERT_EQ(::mknod((src_ + "/whiteout").c_str(), S_IFCHR | 0, makedev(0, 0)), 0);
  ASSERT_EQ(::mknod((src_ + "/null").c_str(), S_IFCHR | 0666, makedev(1, 3)), 0);
  ASSERT_EQ(::mkfifo((src_ + "/fifo").c_str(), 0640), 0);
  ASSERT_EQ(::symlink("/etc/shadow", (src_ + "/abs").c_str()), 0);
  ASSERT_EQ(::symlink("../../..", (src_ + "/up").c_str()), 0);
  ASSERT_EQ(::lchown((src_ + "/abs").c_str(), 42, 43), 0);
  ASSERT_EQ(::link((src_ + "/file").c_str(), (src_ + "/opaque/hard").c_str()), 0);
  ASSERT_EQ(::mkdir((src_ + "/ro").c_str(), 0555), 0);
  Put("ro/kept", "k", 0);

  Status s = Copy();
  ASSERT_TRUE(s.ok()) << s;

  struct stat st;
  ASSERT_EQ(::lstat((dst_ + "/file").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 04750u);
  EXPECT_EQ(st.st_uid, 1234u);
  EXPECT_EQ(st.st_gid, 5678u);
  EXPECT_EQ(st.st_mtim.tv_sec, 1700000000);
  EXPECT_EQ(st.st_mtim.tv_nsec, 123456789);
  EXPECT_EQ(st.st_nlink, 2u);
  EXPECT_EQ(ReadFileToString(dst_ + "/file").value_or(""), "data");
  EXPECT_EQ(Xattr(dst_ + "/file", "user.k"), "v");
  struct stat hard;
  ASSERT_EQ(::lstat((dst_ + "/opaque/hard").c_str(), &hard), 0);
  EXPECT_EQ(hard.st_ino, st.st_ino);

  ASSERT_EQ(::lstat((dst_ + "/opaque").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0710u);
  EXPECT_EQ(Xattr(dst_ + "/opaque", "trusted.overlay.opaque"), "y");
  EXPECT_EQ(ReadFileToString(dst_ + "/opaque/inner").value_or(""), "i");

  ASSERT_EQ(::lstat((dst_ + "/whiteout").c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_EQ(st.st_rdev, makedev(0, 0));
  // A real device node never reaches a layer.
  EXPECT_NE(::lstat((dst_ + "/null").c_str(), &st), 0);
  ASSERT_EQ(::lstat((dst_ + "/fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0640u);

  // Symlinks are copied as links, with their owner, and never followed.
  char target[64] = {};
  ASSERT_GT(::readlink((dst_ + "/abs").c_str(), target, sizeof(target) - 1), 0);
  EXPECT_STREQ(target, "/etc/shadow");
  ASSERT_EQ(::lstat((dst_ + "/abs").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 42u);
  ASSERT_EQ(::lstat((dst_ + "/up").c_str(), &st), 0);
  EXPECT_TRUE(S_ISLNK(st.st_mode));

  ASSERT_EQ(::lstat((dst_ + "/ro").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0555u);
  EXPECT_EQ(ReadFileToString(dst_ + "/ro/kept").value_or(""), "k");
}

TEST_F(FrozenLayerTest, DeepTreeIsRefusedAndLeavesNothing) {
  std::string dir = src_;
  int fd = ::open(src_.c_str(), O_RDONLY | O_DIRECTORY);
  ASSERT_GE(fd, 0);
  for (int i = 0; i < 300; ++i) {
    ASSERT_EQ(::mkdirat(fd, "d", 0755), 0);
    int next = ::openat(fd, "d", O_RDONLY | O_DIRECTORY);
    ::close(fd);
    ASSERT_GE(next, 0);
    fd = next;
  }
  ::close(fd);
  Status s = Copy();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  struct stat st;
  EXPECT_NE(::lstat(dst_.c_str(), &st), 0) << "a partial copy was left";
}

TEST_F(FrozenLayerTest, ExistingDestinationIsNotOverwritten) {
  Put("f", "x");
  ASSERT_EQ(::mkdir(dst_.c_str(), 0700), 0);
  ASSERT_TRUE(WriteStringToFile(dst_ + "/keep", "k").ok());
  EXPECT_EQ(Copy().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ReadFileToString(dst_ + "/keep").value_or(""), "k");
}

TEST_F(FrozenLayerTest, LayerChainAndRemovalWithTheLastReference) {
  Put("a", "1");
  auto fd = OpenFile(src_, O_RDONLY | O_DIRECTORY);
  ASSERT_TRUE(fd.ok());
  std::string layers = tmp_.path() + "/layers";
  auto bottom = FrozenLayer::Create(layers, "l1", fd->get(), nullptr);
  ASSERT_TRUE(bottom.ok()) << bottom.status();
  auto top = FrozenLayer::Create(layers, "l2", fd->get(), *bottom);
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ((*top)->LowerDirs(), (std::vector<std::string>{layers + "/l2", layers + "/l1"}));
  EXPECT_EQ((*top)->depth(), 2u);
  struct stat st;
  bottom->reset();  // the top layer still holds the bottom one
  EXPECT_EQ(::lstat((layers + "/l1/a").c_str(), &st), 0);
  top->reset();
  EXPECT_NE(::lstat((layers + "/l2").c_str(), &st), 0);
  EXPECT_NE(::lstat((layers + "/l1").c_str(), &st), 0);
  // The depth limit.
  std::shared_ptr<const FrozenLayer> chain;
  for (size_t i = 0; i < kMaxFrozenDepth; ++i) {
    auto l = FrozenLayer::Create(layers, "c" + std::to_string(i), fd->get(), chain);
    ASSERT_TRUE(l.ok()) << l.status();
    chain = *l;
  }
  EXPECT_EQ(FrozenLayer::Create(layers, "over", fd->get(), chain).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(::lstat((layers + "/over").c_str(), &st), 0);
}

}  // namespace
}  // namespace bragg::pbox
