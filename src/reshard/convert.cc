#include "reshard/convert.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/fs.h"
#include "common/unique_fd.h"

namespace bragg::reshard {

namespace {

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

Status PreadAll(int fd, char* buf, uint64_t n, uint64_t off, const std::string& name) {
  uint64_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(fd, buf + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r < 0) {
      return ErrnoError("pread", name);
    }
    if (r == 0) {
      return absl::InvalidArgumentError(fmt::format(
          "{} ends at byte {}, before the data the metadata points to", name, off + done));
    }
    done += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

Status PwriteAll(int fd, const char* buf, uint64_t n, uint64_t off, const std::string& name) {
  uint64_t done = 0;
  while (done < n) {
    ssize_t r = ::pwrite(fd, buf + done, n - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) {
      continue;
    }
    if (r < 0) {
      return ErrnoError("pwrite", name);
    }
    done += static_cast<uint64_t>(r);
  }
  return absl::OkStatus();
}

// Starts the writeback of each block of an output shard as soon as every byte planned for it has
// been written. Without it the kernel holds the written pages dirty until dirty_background_ratio
// (10% of RAM) is reached or the shard's fsync: the disk reads the whole checkpoint and only then
// writes it, so a conversion takes read time + write time. Started per complete block, writeback
// never writes a page twice (rows split across chunks land in the same page) and the final fsync
// only waits for the tail. Blocks are counted down by every thread; Account before any worker
// runs, Wrote from any thread.
class WriteBehind {
 public:
  static constexpr uint64_t kBlock = 8 << 20;

  explicit WriteBehind(const Plan& plan) : remaining_(plan.shards.size()) {
    for (size_t s = 0; s < plan.shards.size(); ++s) {
      remaining_[s] =
          std::vector<std::atomic<uint64_t>>((plan.shards[s].size + kBlock - 1) / kBlock);
    }
  }

  // Adds `bytes` at `dst` of `shard` to the bytes its blocks wait for.
  void Account(size_t shard, uint64_t dst, uint64_t bytes) {
    ForEachBlock(shard, dst, bytes, [&](std::atomic<uint64_t>& left, uint64_t n, uint64_t) {
      left.fetch_add(n, std::memory_order_relaxed);
    });
  }

  // Records that `bytes` at `dst` of `shard` (open as `fd`) are written; starts the writeback of
  // each block this completes. Errors: the errno error of sync_file_range.
  Status Wrote(int fd, const std::string& path, size_t shard, uint64_t dst, uint64_t bytes) {
    Status st;
    ForEachBlock(shard, dst, bytes, [&](std::atomic<uint64_t>& left, uint64_t n, uint64_t block) {
      if (left.fetch_sub(n, std::memory_order_acq_rel) == n && st.ok() &&
          ::sync_file_range(fd, static_cast<off_t>(block * kBlock), kBlock,
                            SYNC_FILE_RANGE_WRITE) != 0 &&
          errno != ESPIPE && errno != EINVAL) {
        st = ErrnoError("sync_file_range", path);
      }
    });
    return st;
  }

 private:
  template <typename F>
  void ForEachBlock(size_t shard, uint64_t dst, uint64_t bytes, F&& f) {
    std::vector<std::atomic<uint64_t>>& blocks = remaining_[shard];
    while (bytes > 0) {
      const uint64_t block = dst / kBlock;
      const uint64_t n = std::min(bytes, (block + 1) * kBlock - dst);
      if (block < blocks.size()) {
        f(blocks[block], n, block);
      }
      dst += n;
      bytes -= n;
    }
  }

  std::vector<std::vector<std::atomic<uint64_t>>> remaining_;
};

// Opens the archive of one chunk and checks it holds the tensor the metadata describes.
Result<TensorRef> LocateChunk(int fd, const SourceTensor& t, const SourceChunk& c,
                              const std::string& path) {
  auto ctx = [&](const Status& s) {
    return Annotate(s, fmt::format("{} chunk [{}] in {} at {}", t.key, fmt::join(c.offsets, ","),
                                   path, c.archive_offset));
  };
  auto archive = TorchArchive::Open(fd, c.archive_offset, c.archive_length);
  if (!archive.ok()) {
    return ctx(archive.status());
  }
  auto ref = archive->Tensor(archive->root());
  if (!ref.ok()) {
    return ctx(ref.status());
  }
  if (ref->dtype != t.dtype || ref->shape != c.sizes) {
    return ctx(absl::InvalidArgumentError(fmt::format(
        "archive holds {} [{}], metadata says {} [{}]", SafetensorsDType(ref->dtype),
        fmt::join(ref->shape, ","), SafetensorsDType(t.dtype), fmt::join(c.sizes, ","))));
  }
  return *ref;
}

// Copies (or, with verify, compares) the runs of one work item through a window of `window`
// bytes. Runs are sorted by source offset. `write_behind` is null when verifying.
Status RunItem(const WorkItem& w, const std::string& src_dir, int out_fd, const std::string& out,
               uint64_t window, WriteBehind* write_behind, std::vector<char>* buf,
               std::vector<char>* cmp, std::atomic<uint64_t>* bytes_read) {
  const bool verify = write_behind == nullptr;
  const SourceChunk& c = w.tensor->chunks[w.chunk];
  const std::string path = src_dir + "/" + c.file;
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
  TensorRef ref;
  if (c.resolved) {
    ref.dtype = w.tensor->dtype;
    ref.shape = c.sizes;
    ref.data_offset = c.data_offset;
    ref.bytes = NumElements(c.sizes) * ElementSize(w.tensor->dtype);
  } else {
    BRAGG_ASSIGN_OR_RETURN(ref, LocateChunk(fd.get(), *w.tensor, c, path));
  }
  std::vector<CopyRun> runs = w.runs;
  // Grown to the largest window actually needed: a chunk smaller than the window never costs
  // the whole window's memory.
  window = std::min<uint64_t>(window, ref.bytes > 0 ? ref.bytes : 1);
  size_t i = 0;
  while (i < runs.size()) {
    const uint64_t wstart = runs[i].src;
    const uint64_t wend = wstart + window;
    uint64_t read_end = wstart;
    size_t j = i;
    for (; j < runs.size() && runs[j].src < wend; ++j) {
      read_end = std::max(read_end, std::min(wend, runs[j].src + runs[j].bytes));
    }
    if (read_end > ref.bytes) {
      return absl::InvalidArgumentError(fmt::format("{}: run past the end of chunk", path));
    }
    if (buf->size() < read_end - wstart) {
      buf->resize(read_end - wstart);
    }
    BRAGG_RETURN_IF_ERROR(
        PreadAll(fd.get(), buf->data(), read_end - wstart, ref.data_offset + wstart, path));
    bytes_read->fetch_add(read_end - wstart, std::memory_order_relaxed);
    // The disk reads the next window into the page cache while this one is copied out; it is
    // page cache (reclaimable, one window per thread), not buffer memory of this process.
    if (read_end < ref.bytes) {
      (void)::posix_fadvise(fd.get(), static_cast<off_t>(ref.data_offset + read_end),
                            static_cast<off_t>(std::min(window, ref.bytes - read_end)),
                            POSIX_FADV_WILLNEED);
    }
    size_t next = j;
    for (size_t k = i; k < j; ++k) {
      CopyRun& r = runs[k];
      uint64_t n = std::min(r.bytes, wend - r.src);
      const char* p = buf->data() + (r.src - wstart);
      if (verify) {
        cmp->resize(n);
        BRAGG_RETURN_IF_ERROR(PreadAll(out_fd, cmp->data(), n, r.dst, out));
        if (std::memcmp(cmp->data(), p, n) != 0) {
          return absl::DataLossError(
              fmt::format("verify: {} bytes at {} of {} differ from {} chunk [{}]", n, r.dst, out,
                          w.tensor->key, fmt::join(c.offsets, ",")));
        }
      } else {
        BRAGG_RETURN_IF_ERROR(PwriteAll(out_fd, p, n, r.dst, out));
        BRAGG_RETURN_IF_ERROR(write_behind->Wrote(out_fd, out, w.shard, r.dst, n));
      }
      if (n < r.bytes) {
        r.src += n;
        r.dst += n;
        r.bytes -= n;
        next = std::min(next, k);
      }
    }
    i = next;
  }
  return absl::OkStatus();
}

// Asks the kernel to read the start of an item's chunk into the page cache, so that the disk
// works on the next item while this one is copied. Advisory: errors are ignored (the item's own
// read reports them).
void PrefetchItem(const WorkItem& w, const std::string& src_dir, uint64_t window) {
  const SourceChunk& c = w.tensor->chunks[w.chunk];
  auto fd = OpenFile(src_dir + "/" + c.file, O_RDONLY);
  if (!fd.ok()) {
    return;
  }
  const uint64_t start =
      c.resolved ? c.data_offset + (w.runs.empty() ? 0 : w.runs.front().src) : c.archive_offset;
  const uint64_t len = c.resolved ? w.bytes : c.archive_length;
  (void)::posix_fadvise(fd->get(), static_cast<off_t>(start),
                        static_cast<off_t>(std::min(len, window)), POSIX_FADV_WILLNEED);
}

Status CopyConfigFiles(const std::string& from, const std::string& to) {
  DIR* d = ::opendir(from.c_str());
  if (d == nullptr) {
    return ErrnoError("opendir", from);
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n == "." || n == ".." || n.find(".safetensors") != std::string::npos ||
        n.find(".bin") != std::string::npos || n.find(".tmp") != std::string::npos) {
      continue;
    }
    names.push_back(n);
  }
  ::closedir(d);
  for (const std::string& n : names) {
    struct stat st;
    if (::stat((from + "/" + n).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      continue;
    }
    BRAGG_ASSIGN_OR_RETURN(std::string data, ReadFileToString(from + "/" + n));
    std::string tmp = to + "/." + n + ".tmp";
    BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC));
    BRAGG_RETURN_IF_ERROR(WriteAll(fd.get(), data));
    if (::rename(tmp.c_str(), (to + "/" + n).c_str()) != 0) {
      return ErrnoError("rename", tmp);
    }
  }
  return absl::OkStatus();
}

Result<bool> WriteIndexIfComplete(const Plan& plan, const std::string& dst, int rank) {
  nlohmann::json map = nlohmann::json::object();
  for (const PlannedShard& s : plan.shards) {
    struct stat st;
    if (::stat((dst + "/" + s.file).c_str(), &st) != 0 ||
        static_cast<uint64_t>(st.st_size) != s.size) {
      return false;
    }
    for (const PlannedTensor& t : s.tensors) {
      map[t.map.hf_name] = s.file;
    }
  }
  nlohmann::json index = {{"metadata", {{"total_size", plan.total_bytes}}}, {"weight_map", map}};
  const std::string final_path = dst + "/model.safetensors.index.json";
  const std::string tmp = fmt::format("{}.tmp-{}", final_path, rank);
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(tmp, O_WRONLY | O_CREAT | O_TRUNC));
  BRAGG_RETURN_IF_ERROR(WriteAll(fd.get(), index.dump(2) + "\n"));
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    return ErrnoError("rename", tmp);
  }
  return true;
}

}  // namespace

Result<ConvertStats> ExecutePlan(const Plan& plan, const ConvertOptions& o) {
  ConvertStats stats;
  // Each thread holds at most two windows (the read window and, when verifying, the compare
  // buffer), so threads x 2 x window <= budget; a budget too small for the requested threads at
  // the minimum window runs fewer threads rather than exceed it.
  constexpr uint64_t kMinWindow = 1 << 10;
  constexpr uint64_t kMaxWindow = 64 << 20;
  if (o.mem_budget < 2 * kMinWindow) {
    return absl::InvalidArgumentError(
        fmt::format("--mem-budget {} bytes is below the minimum of {} bytes (two {} KiB windows); "
                    "give at least {}KiB",
                    o.mem_budget, 2 * kMinWindow, kMinWindow >> 10, (2 * kMinWindow) >> 10));
  }
  int threads = std::max(1, o.threads);
  if (static_cast<uint64_t>(threads) * 2 * kMinWindow > o.mem_budget) {
    const int fit = static_cast<int>(o.mem_budget / (2 * kMinWindow));
    spdlog::warn("--mem-budget {} bytes holds the buffers of {} threads, not {}: using {}",
                 o.mem_budget, fit, threads, fit);
    threads = fit;
  }
  const uint64_t window =
      std::clamp<uint64_t>(o.mem_budget / (2 * threads), kMinWindow, kMaxWindow);
  BRAGG_RETURN_IF_ERROR(MakeDirs(o.dst_dir));
  if (o.rank == 0 && !o.hf_config_dir.empty() && !o.verify) {
    BRAGG_RETURN_IF_ERROR(CopyConfigFiles(o.hf_config_dir, o.dst_dir));
  }
  const std::vector<size_t> mine = ShardsForRank(plan, o.rank, o.world_size);
  std::vector<bool> owned(plan.shards.size(), false);
  for (size_t s : mine) {
    owned[s] = true;
  }
  // Open (and preallocate) this rank's shards.
  std::vector<UniqueFd> fds(plan.shards.size());
  std::vector<std::string> paths(plan.shards.size());
  std::vector<std::atomic<int64_t>> pending(plan.shards.size());
  for (size_t s : mine) {
    const PlannedShard& sh = plan.shards[s];
    const std::string final_path = o.dst_dir + "/" + sh.file;
    if (o.verify) {
      paths[s] = final_path;
      BRAGG_ASSIGN_OR_RETURN(fds[s], OpenFile(final_path, O_RDONLY));
      continue;
    }
    paths[s] = fmt::format("{}.tmp-{}", final_path, o.rank);
    // A shard left by an earlier run must not let the index be written early.
    if (::unlink(final_path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoError("unlink", final_path);
    }
    BRAGG_ASSIGN_OR_RETURN(fds[s], OpenFile(paths[s], O_RDWR | O_CREAT | O_TRUNC));
    if (::ftruncate(fds[s].get(), static_cast<off_t>(sh.size)) != 0) {
      return ErrnoError("ftruncate", paths[s]);
    }
    int err = ::posix_fallocate(fds[s].get(), 0, static_cast<off_t>(sh.size));
    if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
      return ErrnoError("posix_fallocate", paths[s], err);
    }
    BRAGG_RETURN_IF_ERROR(PwriteAll(fds[s].get(), sh.header.data(), sh.header.size(), 0, paths[s]));
  }
  std::unique_ptr<WriteBehind> write_behind =
      o.verify ? nullptr : std::make_unique<WriteBehind>(plan);
  std::vector<const WorkItem*> work;
  for (const WorkItem& w : plan.items) {
    if (owned[w.shard]) {
      work.push_back(&w);
      pending[w.shard].fetch_add(1);
      if (write_behind) {
        for (const CopyRun& r : w.runs) {
          write_behind->Account(w.shard, r.dst, r.bytes);
        }
      }
    }
  }
  if (write_behind) {
    for (size_t s : mine) {
      const PlannedShard& sh = plan.shards[s];
      write_behind->Account(s, 0, sh.header.size());
      BRAGG_RETURN_IF_ERROR(write_behind->Wrote(fds[s].get(), paths[s], s, 0, sh.header.size()));
    }
  }
  auto finish_shard = [&](size_t s) -> Status {
    if (o.verify) {
      return absl::OkStatus();
    }
    const std::string final_path = o.dst_dir + "/" + plan.shards[s].file;
    if (::fsync(fds[s].get()) != 0) {
      return ErrnoError("fsync", paths[s]);
    }
    fds[s].Reset();
    if (::rename(paths[s].c_str(), final_path.c_str()) != 0) {
      return ErrnoError("rename", paths[s]);
    }
    return absl::OkStatus();
  };
  for (size_t s : mine) {
    if (pending[s].load() == 0) {
      BRAGG_RETURN_IF_ERROR(finish_shard(s));
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> bytes_done{0};
  std::atomic<bool> failed{false};
  std::atomic<int64_t> last_report_ms{0};
  uint64_t total_work = 0;
  for (const WorkItem* w : work) {
    total_work += w->bytes;
  }
  std::mutex mu;
  Status first_error;
  auto worker = [&]() {
    std::vector<char> buf, cmp;
    while (!failed.load()) {
      size_t k = next.fetch_add(1);
      if (k >= work.size()) {
        return;
      }
      const WorkItem& w = *work[k];
      if (k + 1 < work.size()) {
        PrefetchItem(*work[k + 1], o.src_dir, window);
      }
      Status s = RunItem(w, o.src_dir, fds[w.shard].get(), paths[w.shard], window,
                         write_behind.get(), &buf, &cmp, &bytes_read);
      if (s.ok() && pending[w.shard].fetch_sub(1) == 1) {
        s = finish_shard(w.shard);
      }
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) {
          first_error = s;
        }
        failed = true;
        return;
      }
      uint64_t done = bytes_done.fetch_add(w.bytes) + w.bytes;
      // Progress at most every 5 s, from whichever worker passes the mark.
      int64_t now_ms = static_cast<int64_t>(Since(t0) * 1000);
      int64_t last = last_report_ms.load();
      if (now_ms - last >= 5000 && last_report_ms.compare_exchange_strong(last, now_ms)) {
        spdlog::info("{}: {:.1f}% ({:.2f} of {:.2f} GB), {:.2f} GB/s", o.verify ? "verify" : "copy",
                     100.0 * done / std::max<uint64_t>(total_work, 1), done / 1e9, total_work / 1e9,
                     done / 1e9 / std::max(Since(t0), 1e-9));
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back(worker);
  }
  worker();
  for (std::thread& t : pool) {
    t.join();
  }
  if (!first_error.ok()) {
    for (size_t s : mine) {
      if (!o.verify) {
        ::unlink(paths[s].c_str());
      }
    }
    return first_error;
  }
  double secs = Since(t0);
  (o.verify ? stats.verify_seconds : stats.copy_seconds) = secs;
  stats.bytes_read = bytes_read.load();
  stats.bytes_written = o.verify ? 0 : bytes_done.load();
  stats.shards_written = o.verify ? 0 : static_cast<int>(mine.size());
  spdlog::info("{}: {} shards, {:.3f} GB in {:.2f} s ({:.2f} GB/s read)",
               o.verify ? "verify" : "copy", mine.size(), bytes_done.load() / 1e9, secs,
               secs > 0 ? bytes_read.load() / 1e9 / secs : 0.0);
  if (!o.verify) {
    BRAGG_ASSIGN_OR_RETURN(stats.index_written, WriteIndexIfComplete(plan, o.dst_dir, o.rank));
  }
  return stats;
}

}  // namespace bragg::reshard
