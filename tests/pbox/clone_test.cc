// CloneSandbox through the real pboxd: what clones inherit (files, modes, links, xattrs,
// deletions, spec), isolation between source and clones and among clones, clones of clones,
// the frozen layer's lifetime on disk, admission, sessions and authorization, concurrency,
// and the cleanup of a killed agent's frozen layers.

#include <dirent.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "agent_fixture.h"
#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"

namespace bragg::pbox::testing {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
namespace v1 = bragg::pbox::v1;

constexpr int kMaxSandboxes = 24;

// Entries of the agent's frozen-layer directory (absent counts as empty).
std::vector<std::string> FrozenLayers(const TestAgent& agent) {
  std::vector<std::string> out;
  DIR* d = ::opendir((agent.state_dir() + "/frozen").c_str());
  if (d == nullptr) {
    return out;
  }
  while (struct dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") {
      out.push_back(n);
    }
  }
  ::closedir(d);
  return out;
}

struct Captured {
  ExitInfo exit;
  std::string out;
};

// Runs `argv` to completion with its stdout captured (stderr goes to the test's log).
Result<Captured> RunCapture(const std::vector<std::string>& argv) {
  BRAGG_ASSIGN_OR_RETURN(Pipe pipe, MakePipe());
  SpawnOptions opts;
  opts.stdout_fd = pipe.write.get();
  BRAGG_ASSIGN_OR_RETURN(ChildProcess child, Spawn(argv, opts));
  pipe.write.Reset();
  Captured c;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(pipe.read.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      break;
    }
    c.out.append(buf, static_cast<size_t>(n));
  }
  BRAGG_ASSIGN_OR_RETURN(c.exit, child.Wait(std::chrono::seconds(30)));
  return c;
}

// Polls (generously: the machine is shared) until the frozen-layer directory has `n` entries.
bool WaitForLayers(const TestAgent& agent, size_t n) {
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    if (FrozenLayers(agent).size() == n) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// PBOX_TEST_RUNTIME=gvisor: the agent's default runtime is gVisor (agent_fixture.cc), and the
// clones are gVisor sandboxes too (a clone has its source's runtime).
// Inside the sandbox: `stat -c '%i %h' PATH...`, `stat -c '%a %u' PATH` and `ls -A DIR` in
// Python (os.stat uses fstatat), since coreutils' statx flags fail under gVisor 20221219
// (docs/pbox.md, "The gVisor runtime").
std::string PyStat(const std::string& fields, const std::string& paths) {
  return fmt::format(
      "python3 -c 'import os, sys\nfor p in sys.argv[1:]:\n  s = os.stat(p)\n  "
      "print({})' {}",
      fields, paths);
}
std::string PyListDir(const std::string& dir) {
  return fmt::format("python3 -c 'import os; print(*sorted(os.listdir(\"{}\")), sep=\"\\n\")'",
                     dir);
}

class CloneTest : public SharedAgentTest<CloneTest> {
 public:
  static std::vector<std::string> AgentFlags() {
    return {"--max-sandboxes", std::to_string(kMaxSandboxes)};
  }

 protected:
  void TearDown() override {
    if (!client_) {
      return;
    }
    for (const auto& sb : client_->List().value_or(std::vector<v1::Sandbox>{})) {
      (void)client_->Destroy(sb.id());
    }
    // Every test leaves the agent without sandboxes, hence without frozen layers.
    EXPECT_TRUE(WaitForLayers(*agent_, 0)) << ::testing::PrintToString(FrozenLayers(*agent_));
  }

  v1::Sandbox NewSandbox(v1::SandboxSpec spec = {}, const std::string& session = "") {
    if (spec.memory_bytes() == 0) {
      spec.set_memory_bytes(128 << 20);
    }
    if (spec.disk_bytes() == 0) {
      spec.set_disk_bytes(64 << 20);
    }
    auto sb = client_->Create(spec, session);
    EXPECT_TRUE(sb.ok()) << sb.status();
    return sb.ok() ? *sb : v1::Sandbox();
  }

  std::vector<v1::Sandbox> Clone(const std::string& id, uint32_t n,
                                 const std::string& session = "") {
    auto clones = client_->Clone(id, n, session);
    EXPECT_TRUE(clones.ok()) << clones.status();
    if (!clones.ok()) {
      return {};
    }
    EXPECT_EQ(clones->size(), n);
    return *clones;
  }

  v1::RunResponse Run(const std::string& id, const std::string& script) {
    auto r = client_->Run({.sandbox_id = id, .argv = {"sh", "-c", script}});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : v1::RunResponse();
  }

  std::string Sh(const std::string& id, const std::string& script) {
    auto r = Run(id, script);
    EXPECT_EQ(r.result().exit_code(), 0) << id << ": " << script << "\n" << r.stderr();
    return r.stdout();
  }

  // gVisor: the sandbox's root filesystem as `runsc run` sees it. The bundle's mounts live in
  // a mount namespace of their own, which that process holds (gvisor_runtime.cc); the host's
  // <state>/gvisor/<id>/rootfs is an empty directory.
  std::string GvisorRootfs(const std::string& id) const {
    const std::string bundle = agent_->state_dir() + "/gvisor/" + id;
    const std::string bundle_arg = "--bundle=" + bundle;
    for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
      auto cmdline = ReadFileToString(entry.path().string() + "/cmdline");
      if (!cmdline.ok()) {
        continue;  // not a process, or one that has just gone
      }
      std::vector<std::string> argv;
      std::istringstream args(*cmdline);
      for (std::string arg; std::getline(args, arg, '\0');) {
        argv.push_back(arg);
      }
      if (std::find(argv.begin(), argv.end(), "run") != argv.end() &&
          std::find(argv.begin(), argv.end(), bundle_arg) != argv.end()) {
        return entry.path().string() + "/root" + bundle + "/rootfs";
      }
    }
    ADD_FAILURE() << "no `runsc run` process for " << id;
    return "";
  }

  bool Exists(const std::string& id, const std::string& path) {
    auto st = client_->Stat(id, path);
    EXPECT_TRUE(st.ok() || st.status().code() == absl::StatusCode::kNotFound) << st.status();
    return st.ok();
  }
};

TEST_F(CloneTest, ClonesCarryFilesModesLinksXattrsAndDeletions) {
  v1::Sandbox src = NewSandbox();
  ASSERT_FALSE(src.id().empty());
  // Uploaded files with their modes, an empty file and a 3 MiB one.
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) {
    big[i] = static_cast<char>((i * 2654435761u) >> 13);
  }
  ASSERT_TRUE(client_->WriteFile(src.id(), "/data/in.txt", "prompt 42\n", 0640).ok());
  ASSERT_TRUE(client_->WriteFile(src.id(), "/data/run.sh", "#!/bin/sh\necho ran\n", 0755).ok());
  ASSERT_TRUE(client_->WriteFile(src.id(), "/data/suid", "x", 0711).ok());
  ASSERT_TRUE(client_->WriteFile(src.id(), "/data/empty", "", 0600).ok());
  ASSERT_TRUE(client_->WriteFile(src.id(), "/data/big.bin", big, 0644).ok());
  // Made by processes: a setuid bit, symlinks, a hard link, a fifo, an xattr, a dir mode, and
  // deletions of image files (whiteouts) and of a whole image directory's contents.
  Sh(src.id(),
     "set -e; cd /data; chmod 4711 suid; ln -s in.txt link; ln -s /etc/nowhere dangling; ln in.txt "
     "hard;"
     " mkfifo fifo; mkdir -m 0700 private; echo s > private/secret;"
     " rm /etc/hostname; rm -f /etc/nsswitch.conf; echo new > /etc/hosts");
  if (OnGvisor()) {
    // gVisor 20221219 refuses user.* xattrs to the sandbox's processes (EOPNOTSUPP); set on
    // the source's root as runsc sees it (docs/pbox.md, "The gVisor runtime").
    const std::string in = GvisorRootfs(src.id()) + "/data/in.txt";
    ASSERT_EQ(::setxattr(in.c_str(), "user.prompt", "v1", 2, 0), 0) << in << ": " << errno;
  } else {
    Sh(src.id(), "python3 -c 'import os; os.setxattr(\"/data/in.txt\", \"user.prompt\", b\"v1\")'");
  }
  ASSERT_FALSE(Exists(src.id(), "/etc/hostname"));
  ASSERT_EQ(client_->Stat(src.id(), "/data/suid")->mode(), 04711u);
  EXPECT_EQ(Exists(src.id(), "/data/fifo"), !OnGvisor());

  std::vector<v1::Sandbox> clones = Clone(src.id(), 3);
  ASSERT_EQ(clones.size(), 3u);
  std::set<std::string> ids{src.id()};
  for (const auto& c : clones) {
    SCOPED_TRACE(c.id());
    EXPECT_TRUE(ids.insert(c.id()).second) << "duplicate id";
    auto in = client_->ReadFile(c.id(), "/data/in.txt");
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(*in, "prompt 42\n");
    EXPECT_EQ(client_->Stat(c.id(), "/data/in.txt")->mode(), 0640u);
    EXPECT_EQ(client_->Stat(c.id(), "/data/run.sh")->mode(), 0755u);
    EXPECT_EQ(client_->Stat(c.id(), "/data/suid")->mode(), 04711u);
    EXPECT_EQ(client_->Stat(c.id(), "/data/empty")->size(), 0u);
    auto got_big = client_->ReadFile(c.id(), "/data/big.bin");
    ASSERT_TRUE(got_big.ok());
    EXPECT_TRUE(*got_big == big) << "big.bin differs";
    EXPECT_EQ(Sh(c.id(), "/data/run.sh"), "ran\n");
    EXPECT_EQ(client_->Stat(c.id(), "/data/link")->symlink_target(), "in.txt");
    EXPECT_EQ(client_->Stat(c.id(), "/data/dangling")->symlink_target(), "/etc/nowhere");
    // Hard link kept: same inode for both names, link count 2.
    EXPECT_EQ(
        Sh(c.id(), PyStat("s.st_ino, s.st_nlink", "/data/in.txt /data/hard") + " | uniq | wc -l"),
        "1\n");
    EXPECT_EQ(Sh(c.id(), PyStat("s.st_nlink", "/data/in.txt")), "2\n");
    if (OnGvisor()) {
      // gVisor keeps a FIFO made inside in its own kernel (a synthetic file the gofer never
      // creates on the host): the file API and the copy do not see it.
      EXPECT_FALSE(Exists(c.id(), "/data/fifo"));
    } else {
      EXPECT_EQ(Sh(c.id(), "test -p /data/fifo && echo fifo"), "fifo\n");
    }
    EXPECT_EQ(Sh(c.id(), PyStat("oct(s.st_mode & 0o7777)[2:], s.st_uid", "/data/private")),
              "700 0\n");
    EXPECT_EQ(Sh(c.id(), "cat /data/private/secret"), "s\n");
    if (OnGvisor()) {
      char value[16] = {};
      const std::string in = GvisorRootfs(c.id()) + "/data/in.txt";
      EXPECT_EQ(::getxattr(in.c_str(), "user.prompt", value, sizeof(value)), 2) << in;
      EXPECT_STREQ(value, "v1");
    } else {
      EXPECT_EQ(Sh(c.id(),
                   "python3 -c 'import os; print(os.getxattr(\"/data/in.txt\", "
                   "\"user.prompt\").decode())'"),
                "v1\n");
    }
    // Deleted in the source: deleted in the clone.
    EXPECT_FALSE(Exists(c.id(), "/etc/hostname"));
    EXPECT_FALSE(Exists(c.id(), "/etc/nsswitch.conf"));
    EXPECT_EQ(*client_->ReadFile(c.id(), "/etc/hosts"), "new\n");
    // Untouched image files are still there.
    EXPECT_TRUE(Exists(c.id(), "/etc/passwd"));
    // A deleted file can be made again in a clone.
    ASSERT_TRUE(client_->WriteFile(c.id(), "/etc/hostname", "mine\n").ok());
    EXPECT_EQ(*client_->ReadFile(c.id(), "/etc/hostname"), "mine\n");
  }
  EXPECT_EQ(FrozenLayers(*agent_).size(), 1u);
}

TEST_F(CloneTest, WritesStayInTheirOwnSandbox) {
  v1::Sandbox src = NewSandbox();
  ASSERT_TRUE(client_->WriteFile(src.id(), "/work/shared.txt", "base\n").ok());
  std::vector<v1::Sandbox> clones = Clone(src.id(), 2);
  ASSERT_EQ(clones.size(), 2u);
  const std::string a = clones[0].id(), b = clones[1].id();
  // A write in one clone (new file, modified inherited file, deletion) is invisible elsewhere.
  ASSERT_TRUE(client_->WriteFile(a, "/work/only-a.txt", "a\n").ok());
  Sh(a, "echo a >> /work/shared.txt; rm /etc/passwd");
  EXPECT_EQ(*client_->ReadFile(a, "/work/shared.txt"), "base\na\n");
  EXPECT_FALSE(Exists(src.id(), "/work/only-a.txt"));
  EXPECT_FALSE(Exists(b, "/work/only-a.txt"));
  EXPECT_EQ(*client_->ReadFile(src.id(), "/work/shared.txt"), "base\n");
  EXPECT_EQ(*client_->ReadFile(b, "/work/shared.txt"), "base\n");
  EXPECT_TRUE(Exists(src.id(), "/etc/passwd"));
  EXPECT_TRUE(Exists(b, "/etc/passwd"));
  // A write in the source after cloning is invisible to the clones; the source still writes.
  ASSERT_TRUE(client_->WriteFile(src.id(), "/work/later.txt", "later\n").ok());
  Sh(src.id(), "echo src >> /work/shared.txt");
  EXPECT_EQ(*client_->ReadFile(src.id(), "/work/shared.txt"), "base\nsrc\n");
  EXPECT_FALSE(Exists(a, "/work/later.txt"));
  EXPECT_FALSE(Exists(b, "/work/later.txt"));
  EXPECT_EQ(*client_->ReadFile(b, "/work/shared.txt"), "base\n");
  // Processes are not cloned, and each clone is its own machine: own hostname and pids.
  Sh(src.id(), "sleep 1000 >/dev/null 2>&1 &");
  auto after = Clone(src.id(), 1);
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(Sh(after[0].id(), "ps -e -o comm= | grep -c sleep || true"), "0\n");
  EXPECT_EQ(Sh(after[0].id(), "hostname"), after[0].id() + "\n");
  EXPECT_EQ(*client_->ReadFile(after[0].id(), "/work/later.txt"), "later\n");
}

TEST_F(CloneTest, ClonesInheritTheSpecUnlessOverridden) {
  v1::SandboxSpec spec;
  spec.set_memory_bytes(96 << 20);
  spec.set_pids(100);
  (*spec.mutable_env())["GROUP"] = "g1";
  (*spec.mutable_labels())["task"] = "math";
  spec.set_workdir("/rollout");
  v1::Sandbox src = NewSandbox(spec);
  auto plain = Clone(src.id(), 1);
  ASSERT_EQ(plain.size(), 1u);
  const v1::SandboxSpec& got = plain[0].spec();
  EXPECT_EQ(got.memory_bytes(), 96u << 20);
  EXPECT_EQ(got.pids(), 100u);
  EXPECT_EQ(got.disk_bytes(), 64u << 20);
  EXPECT_EQ(got.workdir(), "/rollout");
  EXPECT_EQ(got.labels().at("task"), "math");
  EXPECT_EQ(got.idle_ttl_seconds(), src.spec().idle_ttl_seconds());
  EXPECT_EQ(Sh(plain[0].id(), "echo $GROUP; pwd"), "g1\n/rollout\n");

  v1::SandboxSpec o;
  o.set_memory_bytes(64 << 20);
  (*o.mutable_env())["SEED"] = "7";
  (*o.mutable_labels())["rollout"] = "3";
  auto over = client_->Clone(src.id(), 1, "", o);
  ASSERT_TRUE(over.ok()) << over.status();
  EXPECT_EQ((*over)[0].spec().memory_bytes(), 64u << 20);
  EXPECT_EQ((*over)[0].spec().pids(), 100u);
  EXPECT_EQ((*over)[0].spec().labels().size(), 2u);
  EXPECT_EQ(Sh((*over)[0].id(), "echo $GROUP $SEED"), "g1 7\n");

  // The image and runtime are the source's; bad overrides fail like bad creates.
  v1::SandboxSpec bad_image;
  bad_image.set_image("nonexistent");
  EXPECT_EQ(client_->Clone(src.id(), 1, "", bad_image).status().code(),
            absl::StatusCode::kInvalidArgument);
  v1::SandboxSpec bad_mem;
  bad_mem.set_memory_bytes(1 << 20);
  EXPECT_EQ(client_->Clone(src.id(), 1, "", bad_mem).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->List()->size(), 3u);
}

TEST_F(CloneTest, CloneOfACloneStacksTheChainAndKeepsOpaqueDirs) {
  v1::Sandbox g0 = NewSandbox();
  Sh(g0.id(), "mkdir -p /d/sub && echo a > /d/a && echo 0 > /gen0 && echo x > /d/sub/x");
  auto g1 = Clone(g0.id(), 1);
  ASSERT_EQ(g1.size(), 1u);
  // In generation 1: replace a directory from the frozen layer by a new one (an opaque
  // directory in its writable layer), delete an inherited file, add one.
  Sh(g1[0].id(), "rm -rf /d && mkdir /d && echo b > /d/b && rm /gen0 && echo 1 > /gen1");
  auto g2 = Clone(g1[0].id(), 2);
  ASSERT_EQ(g2.size(), 2u);
  EXPECT_EQ(FrozenLayers(*agent_).size(), 2u);
  // The parents go first: the chain stays on disk while generation 2 uses it.
  ASSERT_TRUE(client_->Destroy(g0.id()).ok());
  ASSERT_TRUE(client_->Destroy(g1[0].id()).ok());
  EXPECT_EQ(FrozenLayers(*agent_).size(), 2u);
  for (const auto& c : g2) {
    SCOPED_TRACE(c.id());
    EXPECT_EQ(Sh(c.id(), PyListDir("/d")), "b\n");
    EXPECT_FALSE(Exists(c.id(), "/gen0"));
    EXPECT_EQ(*client_->ReadFile(c.id(), "/gen1"), "1\n");
  }
  // A third generation from a second-generation clone that changed nothing of its own.
  auto g3 = Clone(g2[0].id(), 1);
  ASSERT_EQ(g3.size(), 1u);
  EXPECT_EQ(Sh(g3[0].id(), PyListDir("/d") + "; cat /gen1"), "b\n1\n");
  EXPECT_EQ(FrozenLayers(*agent_).size(), 3u);
}

TEST_F(CloneTest, FrozenLayerLeavesDiskWithItsLastUser) {
  v1::Sandbox src = NewSandbox();
  ASSERT_TRUE(client_->WriteFile(src.id(), "/f", "1").ok());
  auto clones = Clone(src.id(), 2);
  ASSERT_EQ(clones.size(), 2u);
  auto layers = FrozenLayers(*agent_);
  ASSERT_EQ(layers.size(), 1u);
  std::string layer = agent_->state_dir() + "/frozen/" + layers[0];
  // The copy on the host holds the uploaded file.
  EXPECT_EQ(ReadFileToString(layer + "/f").value_or("<missing>"), "1");
  ASSERT_TRUE(client_->Destroy(src.id()).ok());
  ASSERT_TRUE(client_->Destroy(clones[0].id()).ok());
  EXPECT_EQ(FrozenLayers(*agent_).size(), 1u);
  EXPECT_EQ(*client_->ReadFile(clones[1].id(), "/f"), "1");
  ASSERT_TRUE(client_->Destroy(clones[1].id()).ok());
  EXPECT_TRUE(WaitForLayers(*agent_, 0));
  struct stat st;
  EXPECT_NE(::lstat(layer.c_str(), &st), 0) << layer << " is still there";
}

TEST_F(CloneTest, BadRequestsFailAndLeaveNothing) {
  v1::Sandbox src = NewSandbox();
  auto zero = client_->Clone(src.id(), 0);
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument) << zero.status();
  auto unknown = client_->Clone("sb-000000000000", 1);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  auto hostile = client_->Clone("../../etc", 1);
  EXPECT_EQ(hostile.status().code(), absl::StatusCode::kNotFound) << hostile.status();
  // More than fit: nothing is created, and the error says so.
  auto live = client_->List()->size();
  auto over = client_->Clone(src.id(), kMaxSandboxes);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("no clone was made"));
  EXPECT_EQ(client_->List()->size(), live);
  EXPECT_TRUE(FrozenLayers(*agent_).empty());
  // Exactly what fits works.
  auto fit = Clone(src.id(), static_cast<uint32_t>(kMaxSandboxes - live));
  EXPECT_EQ(fit.size(), kMaxSandboxes - live);
  EXPECT_EQ(client_->Clone(src.id(), 1).status().code(), absl::StatusCode::kResourceExhausted);
  for (const auto& c : fit) {
    ASSERT_TRUE(client_->Destroy(c.id()).ok());
  }
  // Without the TCP token: refused like every other call.
  auto none = client::Client::Connect({.endpoint = agent_->tcp_endpoint(), .token = ""});
  ASSERT_TRUE(none.ok());
  EXPECT_EQ((*none)->Clone(src.id(), 1).status().code(), absl::StatusCode::kUnauthenticated);
  auto bad = client::Client::Connect(
      {.endpoint = agent_->tcp_endpoint(), .token = "wrong-token-wrong-token"});
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ((*bad)->Clone(src.id(), 1).status().code(), absl::StatusCode::kUnauthenticated);
  auto good =
      client::Client::Connect({.endpoint = agent_->tcp_endpoint(), .token = agent_->token()});
  ASSERT_TRUE(good.ok());
  auto over_tcp = (*good)->Clone(src.id(), 1);
  EXPECT_TRUE(over_tcp.ok()) << over_tcp.status();
}

TEST_F(CloneTest, ClonesShareTheSourcesSessionOnly) {
  auto s1 = client_->OpenSession("clone-test-1");
  auto s2 = client_->OpenSession("clone-test-2");
  ASSERT_TRUE(s1.ok() && s2.ok());
  v1::Sandbox src = NewSandbox({}, (*s1)->id());
  ASSERT_TRUE(client_->WriteFile(src.id(), "/x", "x").ok());
  // Another session cannot copy it; the source's session (named or implied) can.
  auto other = client_->Clone(src.id(), 1, (*s2)->id());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied) << other.status();
  auto closed = client_->Clone(src.id(), 1, "ss-000000000000");
  EXPECT_EQ(closed.status().code(), absl::StatusCode::kPermissionDenied) << closed.status();
  auto named = Clone(src.id(), 1, (*s1)->id());
  auto implied = Clone(src.id(), 2);
  ASSERT_EQ(named.size() + implied.size(), 3u);
  for (const auto* list : {&named, &implied}) {
    for (const auto& c : *list) {
      EXPECT_EQ(c.session_id(), (*s1)->id());
    }
  }
  EXPECT_EQ(FrozenLayers(*agent_).size(), 2u);
  // A detached source may be cloned into a session; the clones then die with it.
  v1::Sandbox detached = NewSandbox();
  auto into = Clone(detached.id(), 1, (*s2)->id());
  ASSERT_EQ(into.size(), 1u);
  EXPECT_EQ(into[0].session_id(), (*s2)->id());
  // The lease ends: the source, its clones and their layers go with it.
  ASSERT_TRUE((*s1)->Close().ok());
  ASSERT_TRUE((*s2)->Close().ok());
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (client_->List()->size() != 1 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(client_->List()->size(), 1u);
  // The detached source's clone went with session 2: no layer is left.
  EXPECT_TRUE(WaitForLayers(*agent_, 0));
}

TEST_F(CloneTest, ConcurrentClonesOfOneSourceWhileItWrites) {
  v1::Sandbox src = NewSandbox();
  ASSERT_TRUE(client_->WriteFile(src.id(), "/seed", "s").ok());
  // The source keeps writing while it is cloned: each snapshot is whole (frozen).
  Sh(src.id(),
     "(i=0; while :; do i=$((i+1)); echo $i > /tick.tmp; mv /tick.tmp /tick; done)"
     " >/dev/null 2>&1 &");
  auto ticking = Clock::now() + std::chrono::seconds(10);
  while (!Exists(src.id(), "/tick") && Clock::now() < ticking) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(Exists(src.id(), "/tick"));
  constexpr int kThreads = 4;
  std::vector<std::vector<v1::Sandbox>> got(kThreads);
  std::vector<Status> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto c = agent_->NewClient();
      auto r = c->Clone(src.id(), 2);
      if (r.ok()) {
        got[t] = *r;
      } else {
        errors[t] = r.status();
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  std::set<std::string> ids;
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(errors[t].ok()) << errors[t];
    for (const auto& c : got[t]) {
      ids.insert(c.id());
      EXPECT_EQ(*client_->ReadFile(c.id(), "/seed"), "s");
      auto tick = client_->ReadFile(c.id(), "/tick");
      ASSERT_TRUE(tick.ok()) << tick.status();
      // Renamed into place whole: a number and its newline.
      EXPECT_THAT(*tick, ::testing::MatchesRegex("[0-9]+\n"));
    }
  }
  EXPECT_EQ(ids.size(), 2u * kThreads);
  EXPECT_EQ(FrozenLayers(*agent_).size(), static_cast<size_t>(kThreads));
  // The source was thawed: it still runs and writes.
  std::string before = *client_->ReadFile(src.id(), "/tick");
  auto deadline = Clock::now() + std::chrono::seconds(10);
  while (*client_->ReadFile(src.id(), "/tick") == before && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(*client_->ReadFile(src.id(), "/tick"), before);
}

// What the source's processes wrote right before the call is in the clones: a file just
// written and closed, one still open in a live process, and a shared mapping still mapped and
// never msync'ed (under gVisor its pages may live in the sentry until the clone's sync).
TEST_F(CloneTest, WritesJustBeforeTheCallAreInTheClones) {
  v1::Sandbox src = NewSandbox();
  Sh(src.id(),
     "mkdir -p /w && (exec 3>/w/open; echo held >&3; exec sleep 1000) >/dev/null 2>&1 &"
     " python3 -c 'import mmap, os, time\n"
     "fd = os.open(\"/w/mapped\", os.O_RDWR | os.O_CREAT, 0o644)\n"
     "os.ftruncate(fd, 4096)\n"
     "m = mmap.mmap(fd, 4096)\n"
     "m[:7] = b\"mapped!\"\n"
     "open(\"/w/mapped.ready\", \"w\").close()\n"
     "time.sleep(1000)' >/dev/null 2>&1 &");
  auto deadline = Clock::now() + std::chrono::seconds(60);
  while ((!Exists(src.id(), "/w/mapped.ready") || !Exists(src.id(), "/w/open")) &&
         Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(Exists(src.id(), "/w/mapped.ready"));
  // Polled until it holds: the background shell may not have written yet.
  while (client_->ReadFile(src.id(), "/w/open").value_or("") != "held\n" &&
         Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Sh(src.id(), "echo last > /w/closed");
  auto clones = Clone(src.id(), 2);
  ASSERT_EQ(clones.size(), 2u);
  for (const auto& c : clones) {
    SCOPED_TRACE(c.id());
    EXPECT_EQ(client_->ReadFile(c.id(), "/w/closed").value_or("<missing>"), "last\n");
    EXPECT_EQ(client_->ReadFile(c.id(), "/w/open").value_or("<missing>"), "held\n");
    auto mapped = client_->ReadFile(c.id(), "/w/mapped");
    ASSERT_TRUE(mapped.ok()) << mapped.status();
    EXPECT_EQ(mapped->substr(0, 7), "mapped!");
    // And as the clone's own processes see it.
    EXPECT_EQ(Sh(c.id(), "head -c 7 /w/mapped; cat /w/closed"), "mapped!last\n");
  }
}

TEST_F(CloneTest, CliClonesAndPrintsIds) {
  v1::Sandbox src = NewSandbox();
  ASSERT_TRUE(client_->WriteFile(src.id(), "/cli", "c").ok());
  auto out = RunCapture(
      {PBOX_CLI_PATH, "--endpoint", agent_->unix_endpoint(), "clone", src.id(), "-n", "2"});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->exit.exit_code, 0);
  std::vector<std::string> ids;
  for (size_t pos = 0; pos < out->out.size();) {
    size_t nl = out->out.find('\n', pos);
    ids.push_back(out->out.substr(pos, nl - pos));
    pos = nl == std::string::npos ? out->out.size() : nl + 1;
  }
  ASSERT_EQ(ids.size(), 2u) << out->out;
  for (const auto& id : ids) {
    EXPECT_EQ(*client_->ReadFile(id, "/cli"), "c");
  }
  auto bad = RunCapture(
      {PBOX_CLI_PATH, "--endpoint", agent_->unix_endpoint(), "clone", src.id(), "-n", "0"});
  ASSERT_TRUE(bad.ok());
  EXPECT_NE(bad->exit.exit_code, 0);
}

// Runs last (gtest keeps file order): kills the agent with clones alive, restarts it, and
// expects the dead agent's frozen layers gone.
TEST_F(CloneTest, ZRestartAfterSigkillRemovesStaleFrozenLayers) {
  v1::Sandbox src = NewSandbox();
  auto clones = Clone(src.id(), 2);
  ASSERT_EQ(clones.size(), 2u);
  ASSERT_EQ(FrozenLayers(*agent_).size(), 1u);
  auto exit = agent_->Stop(SIGKILL);
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(FrozenLayers(*agent_).size(), 1u);  // nobody removed it
  ASSERT_TRUE(agent_->Restart().ok());
  EXPECT_TRUE(FrozenLayers(*agent_).empty());
  client_ = agent_->NewClient();
  EXPECT_TRUE(client_->List()->empty());
  // And cloning works on the new agent.
  v1::Sandbox again = NewSandbox();
  EXPECT_EQ(Clone(again.id(), 1).size(), 1u);
}

}  // namespace
}  // namespace bragg::pbox::testing
