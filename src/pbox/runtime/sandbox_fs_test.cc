#include "pbox/runtime/sandbox_fs.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <limits.h>
#include <stdio.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/fs.h"
#include "fmt/format.h"

namespace bragg::pbox {
namespace {

using absl::StatusCode;

constexpr char kCanary[] = "CANARY-HOST-CONTENT";
constexpr char kSandboxPasswd[] = "sandbox passwd";

std::string ReadAllFd(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) {
      break;
    }
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

bool HostExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

std::set<std::string> HostList(const std::string& dir) {
  std::set<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    return names;
  }
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") {
      names.insert(name);
    }
  }
  ::closedir(d);
  return names;
}

// <base>/root is the sandbox root; <base>/outside is host data the sandbox must never reach.
class SandboxFsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create("/tmp", "bragg-sandbox-fs-");
    ASSERT_TRUE(dir.ok()) << dir.status();
    base_ = std::move(*dir);
    root_ = base_.path() + "/root";
    outside_ = base_.path() + "/outside";
    ASSERT_TRUE(MakeDirs(root_ + "/etc").ok());
    ASSERT_TRUE(MakeDirs(outside_).ok());
    ASSERT_TRUE(WriteStringToFile(root_ + "/etc/passwd", kSandboxPasswd).ok());
    ASSERT_TRUE(WriteStringToFile(outside_ + "/canary", kCanary).ok());
    ASSERT_TRUE(WriteStringToFile(outside_ + "/passwd", kCanary).ok());
    auto fs = SandboxFs::Open(root_);
    ASSERT_TRUE(fs.ok()) << fs.status();
    fs_ = std::make_unique<SandboxFs>(std::move(*fs));
  }

  // The outside directory holds exactly what SetUp put there, untouched.
  void ExpectOutsideUntouched() {
    EXPECT_EQ(HostList(outside_), (std::set<std::string>{"canary", "passwd"}));
    auto canary = ReadFileToString(outside_ + "/canary");
    ASSERT_TRUE(canary.ok()) << canary.status();
    EXPECT_EQ(*canary, kCanary);
    EXPECT_EQ(*ReadFileToString(outside_ + "/passwd"), kCanary);
  }

  void Symlink(const std::string& target, const std::string& rel) {
    ASSERT_EQ(::symlink(target.c_str(), (root_ + "/" + rel).c_str()), 0) << rel;
  }

  std::string ReadSandbox(std::string_view path) {
    auto fd = fs_->OpenRead(path);
    if (!fd.ok()) {
      return "<error: " + std::string(fd.status().message()) + ">";
    }
    return ReadAllFd(fd->get());
  }

  void WriteSandbox(std::string_view path, std::string_view data, bool make_parents = false,
                    bool append = false) {
    auto fd = fs_->OpenWrite(path, 0644, make_parents, append);
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_TRUE(WriteAll(fd->get(), data).ok());
  }

  TempDir base_;
  std::string root_;
  std::string outside_;
  std::unique_ptr<SandboxFs> fs_;
};

// ---- Open -------------------------------------------------------------------------------------

TEST_F(SandboxFsTest, OpenRejectsMissingRootAndNonDirectory) {
  EXPECT_EQ(SandboxFs::Open(base_.path() + "/nope").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(SandboxFs::Open(outside_ + "/canary").status().code(), StatusCode::kInvalidArgument);
}

// ---- Happy paths ------------------------------------------------------------------------------

TEST_F(SandboxFsTest, WriteAppendTruncateAndPread) {
  WriteSandbox("/dir/sub/f", "hello world", /*make_parents=*/true);
  EXPECT_EQ(*ReadFileToString(root_ + "/dir/sub/f"), "hello world");
  EXPECT_EQ(ReadSandbox("dir/sub/f"), "hello world");  // Leading slash is optional.

  WriteSandbox("/dir/sub/f", "!", false, /*append=*/true);
  EXPECT_EQ(ReadSandbox("/dir/sub/f"), "hello world!");

  auto fd = fs_->OpenRead("//dir/./sub//f");
  ASSERT_TRUE(fd.ok()) << fd.status();
  char buf[5];
  ASSERT_EQ(::pread(fd->get(), buf, 5, 6), 5);
  EXPECT_EQ(std::string(buf, 5), "world");
  // The read fd is blocking again and read-only.
  EXPECT_EQ(::fcntl(fd->get(), F_GETFL) & (O_NONBLOCK | O_ACCMODE), O_RDONLY);
  EXPECT_LT(::write(fd->get(), "x", 1), 0);

  WriteSandbox("/dir/sub/f", "x");  // Truncates.
  EXPECT_EQ(ReadSandbox("/dir/sub/f"), "x");

  // Without make_parents a missing parent is NotFound.
  EXPECT_EQ(fs_->OpenWrite("/nodir/f", 0644, false, false).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->OpenRead("/dir/missing").status().code(), StatusCode::kNotFound);
}

TEST_F(SandboxFsTest, StatReportsFields) {
  struct timespec before;
  ::clock_gettime(CLOCK_REALTIME, &before);
  auto fd = fs_->OpenWrite("/f", 0640, false, false);
  ASSERT_TRUE(fd.ok()) << fd.status();
  ASSERT_TRUE(WriteAll(fd->get(), "12345").ok());
  ASSERT_EQ(::fchmod(fd->get(), 0640), 0);  // Independent of the test's umask.
  fd->Reset();

  auto st = fs_->Stat("/f");
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->name, "/f");
  EXPECT_EQ(st->kind, FileKind::kRegular);
  EXPECT_EQ(st->size, 5u);
  EXPECT_EQ(st->mode, 0640u);
  int64_t before_ns = static_cast<int64_t>(before.tv_sec) * 1000000000 + before.tv_nsec;
  EXPECT_GE(st->mtime_ns, before_ns - 2'000'000'000);
  EXPECT_LE(st->mtime_ns, before_ns + 60'000'000'000);

  const struct timespec times[2] = {{0, UTIME_OMIT}, {1234, 567}};
  ASSERT_EQ(::utimensat(AT_FDCWD, (root_ + "/f").c_str(), times, 0), 0);
  EXPECT_EQ(fs_->Stat("f")->mtime_ns, 1234 * 1000000000LL + 567);

  ASSERT_TRUE(fs_->MakeDir("/d", 0711, false).ok());
  ASSERT_EQ(::chmod((root_ + "/d").c_str(), 0711), 0);
  auto dst = fs_->Stat("/d");
  ASSERT_TRUE(dst.ok());
  EXPECT_EQ(dst->kind, FileKind::kDirectory);
  EXPECT_EQ(dst->mode, 0711u);

  Symlink("/etc/passwd", "link");
  auto lst = fs_->Stat("/link");
  ASSERT_TRUE(lst.ok()) << lst.status();
  EXPECT_EQ(lst->kind, FileKind::kSymlink);
  EXPECT_EQ(lst->symlink_target, "/etc/passwd");

  auto rst = fs_->Stat("");
  ASSERT_TRUE(rst.ok());
  EXPECT_EQ(rst->kind, FileKind::kDirectory);
  EXPECT_EQ(fs_->Stat("/")->kind, FileKind::kDirectory);

  ASSERT_EQ(::mkfifo((root_ + "/fifo").c_str(), 0600), 0);
  EXPECT_EQ(fs_->Stat("/fifo")->kind, FileKind::kOther);
  EXPECT_EQ(fs_->Stat("/missing").status().code(), StatusCode::kNotFound);
}

TEST_F(SandboxFsTest, ListDirIsSortedWithKinds) {
  WriteSandbox("/l/a", "a", true);
  WriteSandbox("/l/b", "bb");
  ASSERT_TRUE(fs_->MakeDir("/l/c", 0755, false).ok());
  Symlink("a", "l/0link");
  auto list = fs_->ListDir("/l");
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 4u);
  EXPECT_EQ((*list)[0].name, "0link");
  EXPECT_EQ((*list)[0].kind, FileKind::kSymlink);
  EXPECT_EQ((*list)[0].symlink_target, "a");
  EXPECT_EQ((*list)[1].name, "a");
  EXPECT_EQ((*list)[1].size, 1u);
  EXPECT_EQ((*list)[2].name, "b");
  EXPECT_EQ((*list)[2].size, 2u);
  EXPECT_EQ((*list)[2].kind, FileKind::kRegular);
  EXPECT_EQ((*list)[3].name, "c");
  EXPECT_EQ((*list)[3].kind, FileKind::kDirectory);

  auto root_list = fs_->ListDir("");
  ASSERT_TRUE(root_list.ok());
  std::vector<std::string> names;
  for (const FileStat& e : *root_list) {
    names.push_back(e.name);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"etc", "l"}));

  EXPECT_EQ(fs_->ListDir("/l/a").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->ListDir("/nope").status().code(), StatusCode::kNotFound);
}

TEST_F(SandboxFsTest, MakeDirWithAndWithoutParents) {
  EXPECT_EQ(fs_->MakeDir("/a/b/c", 0755, false).code(), StatusCode::kNotFound);
  ASSERT_TRUE(fs_->MakeDir("/a/b/c", 0700, true).ok());
  struct stat st;
  ASSERT_EQ(::stat((root_ + "/a/b/c").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_TRUE(fs_->MakeDir("/a/b/c", 0700, true).ok());  // mkdir -p of an existing dir.
  EXPECT_EQ(fs_->MakeDir("/a/b/c", 0700, false).code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(fs_->MakeDir("", 0755, true).ok());
  EXPECT_EQ(fs_->MakeDir("/", 0755, false).code(), StatusCode::kAlreadyExists);

  WriteSandbox("/file", "x");
  EXPECT_EQ(fs_->MakeDir("/file", 0755, true).code(), StatusCode::kAlreadyExists);
  EXPECT_FALSE(fs_->MakeDir("/file/sub", 0755, true).ok());
  EXPECT_FALSE(fs_->OpenWrite("/file/sub/f", 0644, true, false).ok());

  // A symlink to a directory inside the root is followed for parents.
  Symlink("/a/b", "ab");
  ASSERT_TRUE(fs_->MakeDir("/ab/d/e", 0755, true).ok());
  EXPECT_TRUE(HostExists(root_ + "/a/b/d/e"));
}

TEST_F(SandboxFsTest, MoveWithAndWithoutNoReplace) {
  WriteSandbox("/src", "S");
  WriteSandbox("/dst", "D");
  EXPECT_EQ(fs_->Move("/src", "/dst", true).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(ReadSandbox("/src"), "S");
  EXPECT_EQ(ReadSandbox("/dst"), "D");
  ASSERT_TRUE(fs_->Move("/src", "/dst", false).ok());
  EXPECT_EQ(ReadSandbox("/dst"), "S");
  EXPECT_FALSE(HostExists(root_ + "/src"));

  ASSERT_TRUE(fs_->MakeDir("/dir", 0755, false).ok());
  ASSERT_TRUE(fs_->Move("/dst", "/dir/moved", true).ok());
  EXPECT_EQ(ReadSandbox("/dir/moved"), "S");
  EXPECT_EQ(fs_->Move("/missing", "/x", false).code(), StatusCode::kNotFound);
  // Into its own subdirectory.
  EXPECT_EQ(fs_->Move("/dir", "/dir/inner", false).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->Move("", "/x", false).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->Move("/dir", "/", false).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->Move("/dir", "/etc/..", false).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(HostExists(root_ + "/dir/moved"));
}

TEST_F(SandboxFsTest, RemoveFilesDirsAndTrees) {
  WriteSandbox("/t/a/b/f", "x", true);
  WriteSandbox("/t/g", "y");
  ASSERT_TRUE(fs_->MakeDir("/empty", 0755, false).ok());
  Symlink("/t", "tlink");

  EXPECT_TRUE(fs_->Remove("/t/g", false).ok());
  EXPECT_FALSE(HostExists(root_ + "/t/g"));
  EXPECT_TRUE(fs_->Remove("/empty", false).ok());
  EXPECT_FALSE(HostExists(root_ + "/empty"));
  Status s = fs_->Remove("/t", false);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;  // ENOTEMPTY
  // Removing a symlink removes the link, not its target.
  EXPECT_TRUE(fs_->Remove("/tlink", true).ok());
  EXPECT_TRUE(HostExists(root_ + "/t/a/b/f"));
  EXPECT_TRUE(fs_->Remove("/t", true).ok());
  EXPECT_FALSE(HostExists(root_ + "/t"));
  EXPECT_EQ(fs_->Remove("/t", true).code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->Remove("/t", false).code(), StatusCode::kNotFound);

  for (std::string_view root_path : {"", "/", "//", "/etc/..", ".", "/etc/."}) {
    Status r = fs_->Remove(root_path, true);
    EXPECT_EQ(r.code(), StatusCode::kInvalidArgument) << root_path << ": " << r;
  }
  EXPECT_TRUE(HostExists(root_ + "/etc/passwd"));
}

// ---- Hostile paths ----------------------------------------------------------------------------

TEST_F(SandboxFsTest, DotDotNeverLeavesTheRoot) {
  EXPECT_EQ(ReadSandbox("../../etc/passwd"), kSandboxPasswd);
  EXPECT_EQ(ReadSandbox("/../../../../../../etc/passwd"), kSandboxPasswd);
  EXPECT_EQ(ReadSandbox("/etc/../../etc/passwd"), kSandboxPasswd);
  // <root>/outside does not exist: the host's sibling directory is not reachable.
  EXPECT_EQ(fs_->OpenRead("../outside/canary").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->Stat("../outside/canary").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->ListDir("../outside").status().code(), StatusCode::kNotFound);

  // Ending in ".." names no entry at all.
  EXPECT_EQ(fs_->Stat("/../../..").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->ListDir("/../../..").status().code(), StatusCode::kInvalidArgument);
  auto listing = fs_->ListDir("/../../../etc");
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_EQ(listing->size(), 1u);
  EXPECT_EQ((*listing)[0].name, "passwd");

  // Writes through ".." land inside.
  EXPECT_FALSE(fs_->OpenWrite("../outside/canary", 0644, false, false).ok());
  WriteSandbox("../../../../outside/new", "inside", /*make_parents=*/true);
  EXPECT_EQ(*ReadFileToString(root_ + "/outside/new"), "inside");
  EXPECT_TRUE(fs_->Remove("../../outside", true).ok());
  EXPECT_FALSE(HostExists(root_ + "/outside"));
  ExpectOutsideUntouched();
}

TEST_F(SandboxFsTest, AbsoluteSymlinkResolvesInsideTheRoot) {
  Symlink("/etc", "evil");
  EXPECT_EQ(ReadSandbox("/evil/passwd"), kSandboxPasswd);
  Symlink("/etc/passwd", "evilfile");
  EXPECT_EQ(ReadSandbox("/evilfile"), kSandboxPasswd);
  // A symlink naming the host path of the outside directory.
  Symlink(outside_, "out");
  EXPECT_EQ(fs_->OpenRead("/out/canary").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->ListDir("/out").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->Stat("/out/canary").status().code(), StatusCode::kNotFound);
  Symlink(outside_ + "/canary", "outfile");
  EXPECT_EQ(fs_->OpenRead("/outfile").status().code(), StatusCode::kNotFound);
  ExpectOutsideUntouched();
}

TEST_F(SandboxFsTest, RelativeSymlinkClimbingOutStaysInside) {
  ASSERT_TRUE(MakeDirs(root_ + "/a/b").ok());
  Symlink("../outside", "rel");
  Symlink("../../../../../../../../../../outside", "a/b/deep");
  Symlink("../../../../../../../../etc/passwd", "a/b/pw");
  EXPECT_EQ(fs_->OpenRead("/rel/canary").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->ListDir("/rel").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->OpenRead("/a/b/deep/canary").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(ReadSandbox("/a/b/pw"), kSandboxPasswd);
  ExpectOutsideUntouched();
}

TEST_F(SandboxFsTest, WritingThroughSymlinksPointingOutsideNeverTouchesTheHost) {
  Symlink(outside_ + "/canary", "abs_file");
  Symlink("../outside/canary", "rel_file");
  Symlink(outside_ + "/created", "abs_new");
  Symlink("../outside/created", "rel_new");
  Symlink(outside_, "abs_dir");
  Symlink("../outside", "rel_dir");
  for (std::string_view p : {"/abs_file", "/rel_file", "/abs_new", "/rel_new", "/abs_dir/canary",
                             "/rel_dir/canary", "/abs_dir/created", "/rel_dir/created"}) {
    for (bool append : {false, true}) {
      auto fd = fs_->OpenWrite(p, 0644, false, append);
      EXPECT_FALSE(fd.ok()) << p;  // The targets' parents do not exist inside the root.
      if (fd.ok()) {
        (void)WriteAll(fd->get(), "PWNED");
      }
    }
  }
  ExpectOutsideUntouched();

  // Once the same path exists inside the root, the symlink resolves there.
  ASSERT_TRUE(MakeDirs(root_ + outside_).ok());
  WriteSandbox("/abs_file", "inside");
  EXPECT_EQ(*ReadFileToString(root_ + outside_ + "/canary"), "inside");
  WriteSandbox("/abs_new", "new");
  EXPECT_EQ(*ReadFileToString(root_ + outside_ + "/created"), "new");
  ExpectOutsideUntouched();
}

TEST_F(SandboxFsTest, MakeParentsThroughSymlinkedDirectoryPointingOutside) {
  Symlink(outside_, "abs_dir");
  Symlink("../outside", "rel_dir");
  Symlink("../../../../..", "up");
  for (std::string_view p : {"/abs_dir/newdir/f", "/rel_dir/newdir/f", "/abs_dir/f"}) {
    auto fd = fs_->OpenWrite(p, 0644, true, false);
    EXPECT_FALSE(fd.ok()) << p;
    Status s = fs_->MakeDir(std::string(p) + "/more", 0755, true);
    EXPECT_FALSE(s.ok()) << p;
  }
  // "up" resolves to the root itself, so parents are created inside it.
  WriteSandbox("/up/outside/newdir/f", "inside", true);
  EXPECT_EQ(*ReadFileToString(root_ + "/outside/newdir/f"), "inside");
  ExpectOutsideUntouched();
  EXPECT_FALSE(HostExists(outside_ + "/newdir"));
}

TEST_F(SandboxFsTest, RecursiveRemoveNeverFollowsSymlinksOut) {
  ASSERT_TRUE(MakeDirs(root_ + "/tree/sub/deeper").ok());
  ASSERT_TRUE(WriteStringToFile(root_ + "/tree/sub/deeper/f", "x").ok());
  Symlink(outside_, "tree/abs");
  Symlink("../../outside", "tree/sub/rel");
  Symlink(outside_ + "/canary", "tree/sub/deeper/file_link");
  Symlink("/", "tree/rootlink");
  ASSERT_TRUE(fs_->Remove("/tree", true).ok());
  EXPECT_FALSE(HostExists(root_ + "/tree"));
  ExpectOutsideUntouched();
  EXPECT_TRUE(HostExists(root_ + "/etc/passwd"));

  // A path through a symlink to outside resolves inside the root: nothing to remove.
  Symlink(outside_, "out");
  EXPECT_EQ(fs_->Remove("/out/canary", false).code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->Remove("/out/canary", true).code(), StatusCode::kNotFound);
  // Removing the symlink itself leaves its target alone.
  EXPECT_TRUE(fs_->Remove("/out", true).ok());
  EXPECT_FALSE(HostExists(root_ + "/out"));
  ExpectOutsideUntouched();
}

TEST_F(SandboxFsTest, RecursiveRemoveStopsAtMountPoints) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root to mount a tmpfs";
  }
  ASSERT_TRUE(MakeDirs(root_ + "/usr").ok());
  auto m = ScopedMount::Mount("tmpfs", root_ + "/usr", "tmpfs", 0, "size=1m");
  if (!m.ok()) {
    GTEST_SKIP() << "cannot mount tmpfs here: " << m.status();
  }
  ASSERT_TRUE(WriteStringToFile(root_ + "/usr/keep", "x").ok());
  Status s = fs_->Remove("/usr", true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(std::string(s.message()).find("mount point"), std::string::npos) << s;
  EXPECT_TRUE(HostExists(root_ + "/usr/keep"));
  // Files inside the mount can still be removed one by one.
  EXPECT_TRUE(fs_->Remove("/usr/keep", false).ok());
  ASSERT_TRUE(m->Unmount().ok());
}

TEST_F(SandboxFsTest, MoveToAndFromOutsideViaSymlinks) {
  Symlink(outside_, "abs_dir");
  Symlink("../outside", "rel_dir");
  WriteSandbox("/mine", "mine");
  for (std::string_view from : {"/abs_dir/canary", "/rel_dir/canary"}) {
    EXPECT_EQ(fs_->Move(from, "/stolen", false).code(), StatusCode::kNotFound) << from;
  }
  for (std::string_view to : {"/abs_dir/mine", "/rel_dir/mine", "/abs_dir/canary"}) {
    EXPECT_EQ(fs_->Move("/mine", to, false).code(), StatusCode::kNotFound) << to;
  }
  EXPECT_FALSE(HostExists(root_ + "/stolen"));
  EXPECT_EQ(ReadSandbox("/mine"), "mine");
  // Moving the symlink itself is a rename inside the root.
  ASSERT_TRUE(fs_->Move("/abs_dir", "/renamed", true).ok());
  EXPECT_EQ(fs_->Stat("/renamed")->symlink_target, outside_);
  ExpectOutsideUntouched();
}

TEST_F(SandboxFsTest, FifoNeverBlocks) {
  ASSERT_EQ(::mkfifo((root_ + "/fifo").c_str(), 0666), 0);
  Symlink("/fifo", "fifolink");
  for (std::string_view p : {"/fifo", "/fifolink"}) {
    auto result = std::async(std::launch::async, [&] { return fs_->OpenRead(p).status(); });
    if (result.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      // Unblock the stuck open so the test can fail instead of hang.
      UniqueFd writer(::open((root_ + "/fifo").c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC));
      result.wait();
      FAIL() << "OpenRead blocked on a FIFO: " << p;
    }
    Status s = result.get();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find("FIFO"), std::string::npos) << s;

    // Writing with no reader and with a reader present.
    EXPECT_EQ(fs_->OpenWrite(p, 0644, false, false).status().code(), StatusCode::kInvalidArgument);
    UniqueFd reader(::open((root_ + "/fifo").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
    ASSERT_TRUE(reader.valid());
    EXPECT_EQ(fs_->OpenWrite(p, 0644, false, true).status().code(), StatusCode::kInvalidArgument);
  }
}

TEST_F(SandboxFsTest, RefusesDirectoriesSocketsAndDevices) {
  EXPECT_EQ(fs_->OpenRead("/etc").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->OpenRead("").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->OpenWrite("/etc", 0644, false, false).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->OpenWrite("/", 0644, true, false).status().code(), StatusCode::kInvalidArgument);

  UniqueFd sock(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(sock.valid());
  struct sockaddr_un addr = {};
  addr.sun_family = AF_UNIX;
  std::string sock_path = root_ + "/sock";
  ASSERT_LT(sock_path.size(), sizeof(addr.sun_path));
  std::copy(sock_path.begin(), sock_path.end(), addr.sun_path);
  ASSERT_EQ(::bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(fs_->OpenRead("/sock").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fs_->OpenWrite("/sock", 0644, false, false).status().code(),
            StatusCode::kInvalidArgument);
  // An upload (the data channel) refuses them alike instead of renaming over them.
  EXPECT_EQ(fs_->CreatePending("/sock", false).status().code(), StatusCode::kInvalidArgument);
  ASSERT_EQ(::mkfifo((root_ + "/fifo").c_str(), 0600), 0);
  EXPECT_EQ(fs_->CreatePending("/fifo", false).status().code(), StatusCode::kInvalidArgument);
  ASSERT_EQ(::symlink("fifo", (root_ + "/to-fifo").c_str()), 0);
  EXPECT_EQ(fs_->CreatePending("/to-fifo", false).status().code(), StatusCode::kInvalidArgument);
  struct stat st;
  ASSERT_EQ(::lstat((root_ + "/fifo").c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));

  if (::mknod((root_ + "/null").c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0) {
    EXPECT_EQ(fs_->OpenRead("/null").status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(fs_->OpenWrite("/null", 0644, false, false).status().code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(fs_->CreatePending("/null", false).status().code(), StatusCode::kInvalidArgument);
  }
}

TEST_F(SandboxFsTest, MagicLinksAreRefused) {
  // Without a procfs inside the root, /proc/self/root is just a missing path.
  Symlink("/proc/self/root", "selfroot");
  EXPECT_EQ(fs_->OpenRead("/selfroot/etc/passwd").status().code(), StatusCode::kNotFound);
  EXPECT_EQ(fs_->OpenRead("/proc/self/root/etc/passwd").status().code(), StatusCode::kNotFound);

  if (::geteuid() != 0) {
    GTEST_SKIP() << "needs root to mount procfs inside the root";
  }
  ASSERT_TRUE(MakeDirs(root_ + "/proc").ok());
  auto m = ScopedMount::Mount("proc", root_ + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC);
  if (!m.ok()) {
    GTEST_SKIP() << "cannot mount procfs here: " << m.status();
  }
  UniqueFd canary_fd(::open((outside_ + "/canary").c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(canary_fd.valid());
  std::string by_fd = fmt::format("/proc/self/fd/{}", canary_fd.get());
  std::string by_thread_fd = fmt::format("/proc/thread-self/fd/{}", canary_fd.get());
  for (const std::string& p : {std::string("/proc/self/root/etc/passwd"),
                               std::string("/selfroot/etc/passwd"), std::string("/proc/self/cwd"),
                               std::string("/proc/1/root/etc/passwd"), by_fd, by_thread_fd}) {
    auto fd = fs_->OpenRead(p);
    EXPECT_FALSE(fd.ok()) << p;
    if (fd.ok()) {
      EXPECT_NE(ReadAllFd(fd->get()), kCanary) << p;
    } else {
      // ELOOP from RESOLVE_NO_MAGICLINKS; another process's links may fail the ptrace access
      // check (EACCES) first.
      EXPECT_TRUE(fd.status().code() == StatusCode::kInvalidArgument ||
                  fd.status().code() == StatusCode::kPermissionDenied)
          << p << ": " << fd.status();
    }
    EXPECT_FALSE(fs_->OpenWrite(p, 0644, false, false).ok()) << p;
    EXPECT_FALSE(fs_->ListDir(p).ok()) << p;
  }
  EXPECT_FALSE(fs_->ListDir("/proc/self/root").ok());
  EXPECT_FALSE(fs_->OpenWrite(by_fd + "/x", 0644, true, false).ok());
  EXPECT_FALSE(fs_->MakeDir("/proc/self/root/tmp/x", 0755, true).ok());
  EXPECT_FALSE(fs_->Move(by_fd, "/stolen", false).ok());
  // Stat does not follow the last component: it reports the magic link itself.
  auto st = fs_->Stat("/proc/self/root");
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->kind, FileKind::kSymlink);
  ExpectOutsideUntouched();
  ASSERT_TRUE(m->Unmount().ok());
}

TEST_F(SandboxFsTest, NulLongAndDotPathsAreInvalid) {
  const std::string nul("etc/pa\0sswd", 11);
  const std::string too_long(PATH_MAX + 10, 'a');
  std::string long_components;
  while (long_components.size() < PATH_MAX) {
    long_components += "/x";
  }
  const std::string long_name(NAME_MAX + 1, 'n');
  for (const std::string& p : {nul, too_long, long_components}) {
    std::vector<Status> results = {
        fs_->Stat(p).status(),
        fs_->OpenRead(p).status(),
        fs_->OpenWrite(p, 0644, true, false).status(),
        fs_->ListDir(p).status(),
        fs_->MakeDir(p, 0755, true),
        fs_->Remove(p, true),
        fs_->Move(p, "/x", false),
        fs_->Move("/etc/passwd", p, false),
    };
    for (const Status& s : results) {
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
      EXPECT_LT(s.message().size(), 600u) << "error messages stay readable";
    }
  }
  Status nul_status = fs_->Stat(nul).status();
  EXPECT_NE(std::string(nul_status.message()).find("NUL"), std::string::npos) << nul_status;
  EXPECT_NE(std::string(nul_status.message()).find("etc/pa\\0sswd"), std::string::npos);
  EXPECT_NE(std::string(fs_->Stat(too_long).status().message()).find("PATH_MAX"),
            std::string::npos);

  EXPECT_EQ(fs_->OpenWrite("/" + long_name, 0644, false, false).status().code(),
            StatusCode::kInvalidArgument);
  for (std::string_view p : {".", "..", "/etc/.", "etc/..", "a/b/../"}) {
    EXPECT_EQ(fs_->Stat(p).status().code(), StatusCode::kInvalidArgument) << p;
    EXPECT_EQ(fs_->OpenWrite(p, 0644, true, false).status().code(), StatusCode::kInvalidArgument)
        << p;
    EXPECT_EQ(fs_->MakeDir(p, 0755, true).code(), StatusCode::kInvalidArgument) << p;
  }
  EXPECT_TRUE(HostExists(root_ + "/etc/passwd"));
  EXPECT_EQ(HostList(root_), (std::set<std::string>{"etc"}));
}

TEST_F(SandboxFsTest, ErrorsNameTheUserPathNotTheHostPath) {
  Status s = fs_->Stat("/missing/dir/x").status();
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(std::string(s.message()).find("/missing/dir/x"), std::string::npos) << s;
  EXPECT_EQ(std::string(s.message()).find(base_.path()), std::string::npos) << s;
  Status m = fs_->Move("/a", "/b/c", true);
  EXPECT_NE(std::string(m.message()).find("/a -> /b/c"), std::string::npos) << m;
  EXPECT_EQ(std::string(m.message()).find(base_.path()), std::string::npos) << m;
  Status w = fs_->OpenWrite("/etc/passwd/x", 0644, true, false).status();
  EXPECT_FALSE(w.ok());
  EXPECT_EQ(std::string(w.message()).find(base_.path()), std::string::npos) << w;
}

// A thread keeps exchanging "d" between a real directory and symlinks to the outside directory
// while other threads operate on paths through "d". Whatever interleaving the kernel sees,
// nothing outside may be read, listed, created or changed.
TEST_F(SandboxFsTest, SymlinkSwapRaceNeverEscapes) {
  ASSERT_TRUE(MakeDirs(root_ + "/d").ok());
  ASSERT_TRUE(WriteStringToFile(root_ + "/d/canary", "inside").ok());
  Symlink(outside_, "s_abs");
  Symlink("../outside", "s_rel");
  struct stat outside_before;
  ASSERT_EQ(::stat(outside_.c_str(), &outside_before), 0);

  std::atomic<bool> stop{false};
  std::atomic<int> swaps{0};
  std::thread swapper([&] {
    const std::string d = root_ + "/d";
    const std::string links[2] = {root_ + "/s_abs", root_ + "/s_rel"};
    for (int i = 0; !stop.load(std::memory_order_relaxed); ++i) {
      const std::string& link = links[i % 2];
      // Exchanging twice restores "d" as the real directory, so "d" is a directory at the end.
      if (::renameat2(AT_FDCWD, d.c_str(), AT_FDCWD, link.c_str(), RENAME_EXCHANGE) == 0) {
        ::renameat2(AT_FDCWD, d.c_str(), AT_FDCWD, link.c_str(), RENAME_EXCHANGE);
        swaps.fetch_add(1, std::memory_order_relaxed);
      }
    }
  });

  std::atomic<int> escapes{0};
  std::atomic<int> reads_ok{0};
  std::atomic<int> writes_ok{0};
  std::atomic<int> lists_ok{0};
  auto worker = [&](int id) {
    for (int i = 0; i < 1500; ++i) {
      auto rfd = fs_->OpenRead(i % 2 ? "/d/canary" : "/d/../d/canary");
      if (rfd.ok()) {
        reads_ok.fetch_add(1);
        if (ReadAllFd(rfd->get()) != "inside") {
          escapes.fetch_add(1);
        }
      }
      auto wfd = fs_->OpenWrite(fmt::format("/d/w{}", id), 0644, false, i % 3 == 0);
      if (wfd.ok()) {
        writes_ok.fetch_add(1);
        (void)WriteAll(wfd->get(), "w");
      }
      auto pfd = fs_->OpenWrite(fmt::format("/d/p{}/q/r", id), 0644, true, false);
      if (pfd.ok()) {
        (void)WriteAll(pfd->get(), "p");
      }
      if (fs_->Stat("/d/passwd").ok()) {
        escapes.fetch_add(1);
      }
      auto st = fs_->Stat("/d/canary");
      if (st.ok() && st->size != 6) {
        escapes.fetch_add(1);
      }
      auto list = fs_->ListDir("/d");
      if (list.ok()) {
        lists_ok.fetch_add(1);
        for (const FileStat& e : *list) {
          if (e.name == "passwd") {
            escapes.fetch_add(1);
          }
        }
      }
      (void)fs_->MakeDir(fmt::format("/d/m{}/n", id), 0755, true);
      (void)fs_->Move(fmt::format("/d/w{}", id), fmt::format("/d/v{}", id), false);
      (void)fs_->Move(fmt::format("/d/v{}", id), fmt::format("/d/w{}", id), true);
      (void)fs_->Remove(fmt::format("/d/p{}", id), true);
      (void)fs_->Remove(fmt::format("/d/m{}", id), true);
    }
  };
  std::thread w1(worker, 1);
  std::thread w2(worker, 2);
  w1.join();
  w2.join();
  stop.store(true);
  swapper.join();

  RecordProperty("swaps", swaps.load());
  RecordProperty("reads_ok", reads_ok.load());
  RecordProperty("writes_ok", writes_ok.load());
  RecordProperty("lists_ok", lists_ok.load());
  EXPECT_EQ(escapes.load(), 0);
  EXPECT_GT(swaps.load(), 0);
  // The race was real: some operations went through the directory.
  EXPECT_GT(reads_ok.load() + writes_ok.load() + lists_ok.load(), 0);
  ExpectOutsideUntouched();
  struct stat outside_after;
  ASSERT_EQ(::stat(outside_.c_str(), &outside_after), 0);
  EXPECT_EQ(outside_after.st_mtim.tv_sec, outside_before.st_mtim.tv_sec);
  EXPECT_EQ(outside_after.st_mtim.tv_nsec, outside_before.st_mtim.tv_nsec);
  EXPECT_FALSE(HostExists(root_ + outside_));
  EXPECT_FALSE(HostExists(root_ + "/outside"));
}

}  // namespace
}  // namespace bragg::pbox
