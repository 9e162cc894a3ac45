#include "reshard/convert.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/fs.h"
#include "common/unique_fd.h"
#include "reshard/file_copy.h"
#include "reshard/test_chunks.h"

namespace bragg::reshard {
namespace {

using testing::Chunked;

// Every chunk's bytes hold the global flat index of each element (as uint32).
std::string ChunkBytes(const SourceTensor& t, const SourceChunk& c) {
  std::string out(NumElements(c.sizes) * 4, '\0');
  std::vector<int64_t> idx(c.sizes.size(), 0);
  for (uint64_t k = 0; k < out.size() / 4; ++k) {
    uint64_t rem = k;
    for (size_t d = c.sizes.size(); d-- > 0;) {
      idx[d] = static_cast<int64_t>(rem % c.sizes[d]) + c.offsets[d];
      rem /= c.sizes[d];
    }
    uint64_t g = 0;
    for (size_t d = 0; d < idx.size(); ++d) {
      g = g * t.shape[d] + idx[d];
    }
    const uint32_t v = static_cast<uint32_t>(g);
    std::memcpy(out.data() + k * 4, &v, 4);
  }
  return out;
}

std::string ReadAll(const std::string& path) {
  auto s = ReadFileToString(path);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : std::string();
}

// A llama-shaped checkpoint (TP=2 x PP=2) whose chunks are resolved into one data file, large
// enough that row-split runs are 64 KiB and more (copied whole) and column-split ones are rows
// of 0.5 KiB (linear_proj) and 2 KiB (linear_fc2), gathered.
class ConvertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cfg = ParseModelConfig("llama", R"({"hidden_size": 256, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 1024,
      "vocab_size": 10, "tie_word_embeddings": false})");
    ASSERT_TRUE(cfg.ok()) << cfg.status();
    cfg_ = *cfg;
    auto dir = TempDir::Create(::testing::TempDir().empty() ? "/tmp" : ::testing::TempDir(),
                               "bragg-convert-");
    ASSERT_TRUE(dir.ok()) << dir.status();
    src_ = std::move(*dir);
    const int64_t L = 4, h = 256, qkv = (4 + 2 * 2) * 64;
    auto add = [&](SourceTensor t) { idx_.tensors[t.key] = std::move(t); };
    add(Chunked("embedding.word_embeddings.weight", {12, h}, {2, 1}));
    add(Chunked("output_layer.weight", {12, h}, {2, 1}));
    add(Chunked("decoder.final_layernorm.weight", {h}, {1}));
    const std::string p = "decoder.layers.";
    add(Chunked(p + "self_attention.linear_qkv.layer_norm_weight", {L, h}, {2, 1}));
    add(Chunked(p + "self_attention.linear_qkv.weight", {L, qkv, h}, {2, 2, 1}));
    add(Chunked(p + "self_attention.linear_proj.weight", {L, h, h}, {2, 1, 2}));
    add(Chunked(p + "mlp.linear_fc1.layer_norm_weight", {L, h}, {2, 1}));
    add(Chunked(p + "mlp.linear_fc1.weight", {L, 2 * 1024, h}, {2, 2, 1}));
    add(Chunked(p + "mlp.linear_fc2.weight", {L, h, 1024}, {2, 1, 2}));
    std::string data = "pad";  // data offsets not page-aligned, as inside torch archives
    for (auto& [key, t] : idx_.tensors) {
      for (SourceChunk& c : t.chunks) {
        c.file = "data.bin";
        c.resolved = true;
        c.data_offset = data.size();
        data += ChunkBytes(t, c);
      }
    }
    idx_.dir = src_.path();
    WriteFile(src_.path() + "/data.bin", data);
    auto plan = BuildPlan(idx_, cfg_, 3 << 20);  // several shards
    ASSERT_TRUE(plan.ok()) << plan.status();
    plan_ = std::move(*plan);
    ASSERT_GT(plan_.shards.size(), 2u);
    // The expected shards: the plan's runs applied in memory.
    for (const PlannedShard& s : plan_.shards) {
      expected_.push_back(std::string(s.size, '\0'));
      expected_.back().replace(0, s.header.size(), s.header);
    }
    for (const WorkItem& w : plan_.items) {
      const SourceChunk& c = w.tensor->chunks[w.chunk];
      for (const CopyRun& r : w.runs) {
        expected_[w.shard].replace(r.dst, r.bytes, data, c.data_offset + r.src, r.bytes);
      }
    }
  }

  static void WriteFile(const std::string& path, const std::string& data) {
    auto fd = OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC);
    ASSERT_TRUE(fd.ok()) << fd.status();
    ASSERT_TRUE(WriteAll(fd->get(), data).ok());
  }

  ConvertOptions Options(const std::string& dst, CopyMethod m, int threads, uint64_t budget) {
    ConvertOptions o;
    o.src_dir = src_.path();
    o.dst_dir = dst;
    o.threads = threads;
    o.mem_budget = budget;
    o.copy_method = m;
    return o;
  }

  void ExpectShards(const std::string& dst, const std::string& what) {
    for (size_t s = 0; s < plan_.shards.size(); ++s) {
      const std::string got = ReadAll(dst + "/" + plan_.shards[s].file);
      ASSERT_EQ(got.size(), expected_[s].size()) << what;
      ASSERT_TRUE(got == expected_[s]) << what << ": " << plan_.shards[s].file << " differs";
    }
  }

  ModelConfig cfg_;
  TempDir src_;
  CheckpointIndex idx_;
  Plan plan_;
  std::vector<std::string> expected_;
};

// Whether this kernel copies between two files of `dir` with copy_file_range.
bool KernelCopiesIn(const std::string& dir) {
  auto a = OpenFile(dir + "/probe-a", O_RDWR | O_CREAT | O_TRUNC);
  auto b = OpenFile(dir + "/probe-b", O_RDWR | O_CREAT | O_TRUNC);
  if (!a.ok() || !b.ok() || !WriteAll(a->get(), "probe").ok()) {
    return false;
  }
  loff_t in = 0, out = 0;
  const bool ok = ::copy_file_range(a->get(), &in, b->get(), &out, 5, 0) == 5;
  ::unlink((dir + "/probe-a").c_str());
  ::unlink((dir + "/probe-b").c_str());
  return ok;
}

TEST_F(ConvertTest, EveryCopyMethodWritesTheSameBytes) {
  auto same = TempDir::Create(src_.path(), "out-");
  ASSERT_TRUE(same.ok());
  std::vector<std::pair<std::string, bool>> dsts = {{same->path(), true}};
  // A destination on another file system: copy_file_range refuses (EXDEV) and the copy falls
  // back to the mapped windows.
  struct stat a, b;
  std::optional<TempDir> other;
  if (::stat("/dev/shm", &a) == 0 && ::stat(src_.path().c_str(), &b) == 0 && a.st_dev != b.st_dev &&
      ::access("/dev/shm", W_OK) == 0) {
    auto d = TempDir::Create("/dev/shm", "bragg-convert-");
    ASSERT_TRUE(d.ok());
    other = std::move(*d);
    dsts.emplace_back(other->path(), false);
  }
  const bool kernel_copies = KernelCopiesIn(src_.path());
  const CopyMethod methods[] = {CopyMethod::kPread, CopyMethod::kMmap, CopyMethod::kCopyFileRange,
                                CopyMethod::kAuto};
  // 3 threads in 24 KiB: 4 KiB windows, so runs span several windows and gather units are a few
  // rows. In 6 KiB: 1 KiB windows, so a linear_fc2 row (2 KiB) is more than a gather unit can
  // map: those rows are copied run by run, the fallback of gathering.
  const std::pair<int, uint64_t> shapes[] = {{1, 1ull << 30}, {3, 24 << 10}, {3, 6 << 10}};
  for (const auto& [dst, same_fs] : dsts) {
    for (CopyMethod m : methods) {
      for (const auto& [threads, budget] : shapes) {
        const std::string what = fmt::format("{} method {} threads {} budget {}", dst,
                                             static_cast<int>(m), threads, budget);
        const std::string out = dst + "/run";
        ASSERT_TRUE(RemoveTree(out).ok());
        auto st = ExecutePlan(plan_, Options(out, m, threads, budget));
        ASSERT_TRUE(st.ok()) << what << ": " << st.status();
        ExpectShards(out, what);
        EXPECT_TRUE(st->index_written) << what;
        if (m == CopyMethod::kPread || m == CopyMethod::kMmap) {
          EXPECT_EQ(st->bytes_kernel_copied, 0u) << what;
        }
        if (m == CopyMethod::kPread) {
          EXPECT_EQ(st->bytes_gathered, 0u) << what;
        } else {
          // linear_proj and linear_fc2 rows are gathered, into far fewer writes.
          // All of linear_proj (1 MiB) and linear_fc2 (4 MiB); in 1 KiB windows not linear_fc2.
          EXPECT_EQ(st->bytes_gathered, budget == 6 << 10 ? 1u << 20 : 5u << 20) << what;
          if (budget == 1ull << 30) {
            EXPECT_LT(st->gathered_writes * 64, st->bytes_gathered / 1024) << what;
          }
        }
        if (m == CopyMethod::kCopyFileRange && budget == 1ull << 30) {
          if (same_fs && kernel_copies) {
            EXPECT_GT(st->bytes_kernel_copied, 4u << 20) << what;
          }
          if (!same_fs) {
            EXPECT_EQ(st->bytes_kernel_copied, 0u) << what;
          }
        }
        // --verify passes, and finds one changed byte.
        ConvertOptions v = Options(out, m, threads, budget);
        v.verify = true;
        auto vs = ExecutePlan(plan_, v);
        ASSERT_TRUE(vs.ok()) << what << ": " << vs.status();
        const std::string last = out + "/" + plan_.shards.back().file;
        auto fd = OpenFile(last, O_RDWR);
        ASSERT_TRUE(fd.ok());
        ASSERT_EQ(::pwrite(fd->get(), "\x5A", 1, plan_.shards.back().size - 3), 1);
        vs = ExecutePlan(plan_, v);
        EXPECT_TRUE(absl::IsDataLoss(vs.status())) << what << ": " << vs.status();
      }
    }
  }
}

TEST_F(ConvertTest, SourceShorterThanMetadataFailsCleanly) {
  // Mapping past the end of a file would raise SIGBUS: every method must report it instead.
  const std::string data = src_.path() + "/data.bin";
  struct stat st;
  ASSERT_EQ(::stat(data.c_str(), &st), 0);
  // Half the chunks now end past the end of the file.
  ASSERT_EQ(::truncate(data.c_str(), st.st_size / 2), 0);
  for (CopyMethod m :
       {CopyMethod::kPread, CopyMethod::kMmap, CopyMethod::kCopyFileRange, CopyMethod::kAuto}) {
    auto out = TempDir::Create(src_.path(), "out-");
    ASSERT_TRUE(out.ok());
    auto r = ExecutePlan(plan_, Options(out->path(), m, 2, 1ull << 30));
    ASSERT_FALSE(r.ok()) << static_cast<int>(m);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
    EXPECT_NE(std::string(r.status().message()).find("data.bin ends at byte"), std::string::npos)
        << r.status();
    EXPECT_NE(::access((out->path() + "/model.safetensors.index.json").c_str(), F_OK), 0);
  }
}

TEST_F(ConvertTest, ShardsOfAnotherRunNeverCompleteTheIndex) {
  auto out = TempDir::Create(src_.path(), "out-");
  ASSERT_TRUE(out.ok());
  const std::string index = out->path() + "/model.safetensors.index.json";
  ConvertOptions o = Options(out->path(), CopyMethod::kAuto, 2, 1ull << 30);
  o.world_size = 2;
  for (int rank : {0, 1}) {
    o.rank = rank;
    auto st = ExecutePlan(plan_, o);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->index_written, rank == 1);
  }
  ASSERT_EQ(::access(index.c_str(), F_OK), 0);
  // A second run (another id, same shard sizes): rank 0 alone must not publish an index over
  // rank 1's leftovers, and the old index is gone.
  Plan again = plan_;
  ASSERT_TRUE(AssignRunId(&again, src_.path()).ok());
  ASSERT_NE(again.run_id, plan_.run_id);
  ASSERT_EQ(again.run_id.size(), 16u);
  EXPECT_NE(again.shards[0].header.find(again.run_id), std::string::npos);
  EXPECT_EQ(again.shards[0].header.size(), plan_.shards[0].header.size());
  o.rank = 0;
  auto st = ExecutePlan(again, o);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(st->index_written);
  EXPECT_FALSE(st->index_waits_for.empty());
  EXPECT_NE(::access(index.c_str(), F_OK), 0);
  o.rank = 1;
  st = ExecutePlan(again, o);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->index_written);
  // The id depends on the inputs only: computed again, it is the same.
  Plan third = plan_;
  ASSERT_TRUE(AssignRunId(&third, src_.path()).ok());
  EXPECT_EQ(third.run_id, again.run_id);
  ASSERT_EQ(::utimensat(AT_FDCWD, (src_.path() + "/data.bin").c_str(), nullptr, 0), 0);
  Plan touched = plan_;
  ASSERT_TRUE(AssignRunId(&touched, src_.path()).ok());
  EXPECT_NE(touched.run_id, again.run_id);
}

TEST_F(ConvertTest, FailureLeavesNoTemporaryShards) {
  // The second shard of this rank cannot be created (its temporary path is a directory): the
  // first one, already preallocated to its full size, must not stay behind.
  auto out = TempDir::Create(src_.path(), "out-");
  ASSERT_TRUE(out.ok());
  const std::vector<size_t> mine = ShardsForRank(plan_, 0, 1);
  ASSERT_GT(mine.size(), 1u);
  const std::string blocked = out->path() + "/" + plan_.shards[mine[1]].file + ".tmp-0";
  ASSERT_EQ(::mkdir(blocked.c_str(), 0755), 0);
  auto st = ExecutePlan(plan_, Options(out->path(), CopyMethod::kAuto, 2, 1ull << 30));
  ASSERT_FALSE(st.ok());
  EXPECT_NE(std::string(st.status().message()).find(blocked), std::string::npos) << st.status();
  ASSERT_EQ(::rmdir(blocked.c_str()), 0);
  for (const PlannedShard& s : plan_.shards) {
    EXPECT_NE(::access((out->path() + "/" + s.file + ".tmp-0").c_str(), F_OK), 0) << s.file;
  }
  // A failure while copying (a source truncated to a tenth) cleans up too.
  const std::string data = src_.path() + "/data.bin";
  struct stat sb;
  ASSERT_EQ(::stat(data.c_str(), &sb), 0);
  ASSERT_EQ(::truncate(data.c_str(), sb.st_size / 10), 0);
  st = ExecutePlan(plan_, Options(out->path(), CopyMethod::kPread, 3, 1ull << 30));
  ASSERT_FALSE(st.ok());
  for (const PlannedShard& s : plan_.shards) {
    EXPECT_NE(::access((out->path() + "/" + s.file + ".tmp-0").c_str(), F_OK), 0) << s.file;
  }
}

// Runs `body` in a child process (rlimits set there stay there); true when it exits 0.
template <typename F>
bool InChild(F&& body) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::_exit(body() ? 0 : 1);
  }
  int status = 0;
  return pid > 0 && ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) &&
         WEXITSTATUS(status) == 0;
}

int OpenFds() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) {
    n += ::fcntl(fd, F_GETFD) != -1;
  }
  return n;
}

TEST_F(ConvertTest, OpenFileLimitIsRaisedOrRefusedEarly) {
  ASSERT_GT(ShardsForRank(plan_, 0, 1).size(), 4u);
  // A soft limit too low for this rank's shards: raised to the hard limit, and it converts.
  EXPECT_TRUE(InChild([&] {
    auto out = TempDir::Create(src_.path(), "out-");
    struct rlimit rl;
    ::getrlimit(RLIMIT_NOFILE, &rl);
    const rlim_t hard = rl.rlim_max;
    rl.rlim_cur = static_cast<rlim_t>(OpenFds() + 3);
    if (!out.ok() || ::setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      return false;
    }
    auto st = ExecutePlan(plan_, Options(out->path(), CopyMethod::kAuto, 2, 1ull << 30));
    struct rlimit now;
    ::getrlimit(RLIMIT_NOFILE, &now);
    if (!st.ok() || !st->index_written || now.rlim_cur != hard) {
      fmt::print(stderr, "raise: {} soft {}\n", st.status().ToString(), now.rlim_cur);
      return false;
    }
    return true;
  }));
  // A hard limit too low: refused before any shard exists, saying what to do.
  EXPECT_TRUE(InChild([&] {
    auto out = TempDir::Create(src_.path(), "out-");
    const rlim_t low = static_cast<rlim_t>(OpenFds() + 3);
    struct rlimit rl = {low, low};
    if (!out.ok() || ::setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      return false;
    }
    auto st = ExecutePlan(plan_, Options(out->path(), CopyMethod::kAuto, 2, 1ull << 30));
    const std::string msg(st.status().message());
    bool clean = true;
    for (const PlannedShard& s : plan_.shards) {
      clean = clean && ::access((out->path() + "/" + s.file + ".tmp-0").c_str(), F_OK) != 0;
    }
    if (!absl::IsFailedPrecondition(st.status()) ||
        msg.find("RLIMIT_NOFILE") == std::string::npos ||
        msg.find("--world-size") == std::string::npos || !clean) {
      fmt::print(stderr, "refuse: {}\n", st.status().ToString());
      return false;
    }
    return true;
  }));
}

TEST(ParseCopyMethodTest, NamesAndErrors) {
  EXPECT_EQ(*ParseCopyMethod("auto"), CopyMethod::kAuto);
  EXPECT_EQ(*ParseCopyMethod("copy_file_range"), CopyMethod::kCopyFileRange);
  EXPECT_EQ(*ParseCopyMethod("mmap"), CopyMethod::kMmap);
  EXPECT_EQ(*ParseCopyMethod("pread"), CopyMethod::kPread);
  auto bad = ParseCopyMethod("splice");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("auto, copy_file_range, mmap or pread"),
            std::string::npos);
}

TEST(FileCopyTest, CopyFileRangeSignalsFallbackForAPipe) {
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  UniqueFd r(p[0]), w(p[1]);
  ASSERT_EQ(::write(w.get(), "abcdef", 6), 6);
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  auto out = OpenFile(dir->path() + "/out", O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_TRUE(out.ok());
  // copy_file_range needs regular files (EINVAL): nothing copied, no error, the caller falls back.
  auto n = CopyFileRangeAll(r.get(), 0, out->get(), 0, 6, "pipe", "out");
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 0u);
  // A closed output is a real error only if the kernel says so; EBADF falls back too.
  auto in = OpenFile(dir->path() + "/in", O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_TRUE(in.ok());
  ASSERT_TRUE(WriteAll(in->get(), "0123456789").ok());
  n = CopyFileRangeAll(in->get(), 2, out->get(), 1, 8, "in", "out");
  ASSERT_TRUE(n.ok()) << n.status();
  if (*n == 8) {
    EXPECT_EQ(ReadAll(dir->path() + "/out"), std::string("\0"
                                                         "23456789",
                                                         9));
  }
  // Past the end of the source: InvalidArgument naming it.
  n = CopyFileRangeAll(in->get(), 6, out->get(), 0, 8, "in", "out");
  if (!n.ok()) {
    EXPECT_NE(std::string(n.status().message()).find("in ends at byte 10"), std::string::npos);
  } else {
    EXPECT_LT(*n, 8u);  // the kernel refused before any byte: the fallback reports it
  }
}

TEST(FileCopyTest, PwritevAllWritesEveryBufferInOrder) {
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  auto fd = OpenFile(dir->path() + "/f", O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_TRUE(fd.ok());
  std::string a(100000, 'a'), b = "bb", c(70000, 'c');
  iovec iov[] = {{a.data(), a.size()}, {b.data(), b.size()}, {c.data(), c.size()}};
  ASSERT_TRUE(PwritevAll(fd->get(), iov, 3, 5, "f").ok());
  EXPECT_EQ(ReadAll(dir->path() + "/f"), std::string(5, '\0') + a + b + c);
  UniqueFd ro = std::move(*OpenFile(dir->path() + "/f", O_RDONLY));
  iovec one[] = {{b.data(), b.size()}};
  auto st = PwritevAll(ro.get(), one, 1, 0, "f");
  EXPECT_NE(std::string(st.message()).find("pwritev"), std::string::npos) << st;
}

TEST(FileCopyTest, MappedRangeUnalignedAndPastTheEnd) {
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  std::string data(3 * 4096 + 17, '\0');
  for (size_t i = 0; i < data.size(); ++i) {
    data[i] = static_cast<char>(i * 7);
  }
  auto fd = OpenFile(dir->path() + "/f", O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(WriteAll(fd->get(), data).ok());
  auto m = MappedRange::Map(fd->get(), 4099, 5000, "f");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(std::memcmp(m->data(), data.data() + 4099, 5000), 0);
  MappedRange moved = std::move(*m);
  EXPECT_EQ(moved.data()[0], data[4099]);
  auto past = MappedRange::Map(fd->get(), data.size() - 10, 11, "f");
  ASSERT_FALSE(past.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(past.status())) << past.status();
  EXPECT_FALSE(MappedRange::Map(fd->get(), 0, 0, "f").ok());
}

// A file truncated under a live mapping: user-space reads of the lost pages raise SIGBUS and
// system calls reading them fail with EFAULT. Both must come back as errors naming the cause.
TEST(FileCopyTest, TruncatedUnderAMappingIsAnErrorNotSigbus) {
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::string data(3 * page, '\0');
  for (size_t i = 0; i < data.size(); ++i) {
    data[i] = static_cast<char>(i * 13 + 1);
  }
  auto fd = OpenFile(dir->path() + "/f", O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(WriteAll(fd->get(), data).ok());
  auto m = MappedRange::Map(fd->get(), 100, data.size() - 100, "f");
  ASSERT_TRUE(m.ok()) << m.status();
  auto same = m->Equals(0, data.data() + 100, data.size() - 100, "f");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(*same);
  std::string other = data.substr(100);
  other[other.size() - 1] ^= 1;
  same = m->Equals(0, other.data(), other.size(), "f");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_FALSE(*same);
  EXPECT_TRUE(absl::IsOutOfRange(m->Equals(1, data.data(), data.size() - 100, "f").status()));

  ASSERT_EQ(::ftruncate(fd->get(), static_cast<off_t>(page)), 0);
  // The last two pages are gone: a guarded read of them is an error, twice (the guard re-arms),
  // while the first page still compares.
  for (int i = 0; i < 2; ++i) {
    same = m->Equals(0, data.data() + 100, data.size() - 100, "f");
    ASSERT_FALSE(same.ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(same.status())) << same.status();
    EXPECT_NE(std::string(same.status().message()).find("truncated"), std::string::npos);
  }
  same = m->Equals(0, data.data() + 100, page - 100, "f");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(*same);
  // Writing from the lost pages: EFAULT, reported as the same cause.
  auto out = OpenFile(dir->path() + "/out", O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_TRUE(out.ok());
  Status st = PwriteAll(out->get(), m->data(), data.size() - 100, 0, "out");
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_NE(std::string(st.message()).find("truncated"), std::string::npos) << st;
  iovec iov[] = {{const_cast<char*>(m->data()), data.size() - 100}};
  st = PwritevAll(out->get(), iov, 1, 0, "out");
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
}

// The handler catches only guarded reads: any other SIGBUS still ends the process.
TEST(FileCopyDeathTest, UnguardedSigbusStillKills) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  auto fd = OpenFile(dir->path() + "/f", O_RDWR | O_CREAT | O_TRUNC);
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(WriteAll(fd->get(), std::string(2 * page, 'x')).ok());
  EXPECT_EXIT(
      {
        auto m = MappedRange::Map(fd->get(), 0, 2 * page, "f");
        if (!m.ok()) {
          _exit(3);
        }
        std::string x(2 * page, 'x');
        if (!m->Equals(0, x.data(), x.size(), "f").ok()) {  // installs the handler
          _exit(4);
        }
        if (::ftruncate(fd->get(), 0) != 0) {
          _exit(5);
        }
        volatile char c = m->data()[page];  // no guard: SIGBUS
        (void)c;
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
  // Nor does a SIGBUS sent by another process (or raised) get lost in the handler.
  EXPECT_EXIT(
      {
        auto m = MappedRange::Map(fd->get(), 0, page, "f");
        if (!m.ok() || !m->Equals(0, m->data(), page, "f").ok()) {
          _exit(3);
        }
        ::kill(::getpid(), SIGBUS);
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
}

}  // namespace
}  // namespace bragg::reshard
