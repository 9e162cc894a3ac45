#include "reshard/convert.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "common/fs.h"
#include "common/unique_fd.h"
#include "reshard/file_copy.h"

namespace bragg::reshard {

namespace {

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
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
  auto archive =
      TorchArchive::Open(fd, c.archive_offset, c.archive_length, TorchArchive::ChunkLimits());
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

// An item whose runs average less than this is scattered (a column-split tensor: one run per
// row): its runs are gathered with those of the tensor's other chunks into whole output ranges,
// so that each write covers many rows instead of one.
constexpr uint64_t kSmallRun = 64 << 10;
// Runs below this are written from the window (mapped) instead of with a copy_file_range call
// each, like the rows of a scattered item.
constexpr uint64_t kMinKernelCopy = 64 << 10;

// Data offsets of the chunks opened so far: a chunk split over several tasks parses its archive
// once (also when several threads need it at the same time), and a task is prefetched at its
// first byte. Thread-safe.
class ChunkRefs {
 public:
  // The chunk of `w`, open as `fd` at `path`: resolved by the index, cached, or located now.
  Result<TensorRef> Get(const WorkItem& w, int fd, const std::string& path) {
    const SourceChunk& c = w.tensor->chunks[w.chunk];
    if (c.resolved) {
      TensorRef ref;
      ref.dtype = w.tensor->dtype;
      ref.shape = c.sizes;
      ref.data_offset = c.data_offset;
      ref.bytes = NumElements(c.sizes) * ElementSize(w.tensor->dtype);
      return ref;
    }
    std::unique_lock<std::mutex> lock(mu_);
    // One thread parses a chunk's archive; others needing it meanwhile wait for its result
    // (after a failure, the next one tries again).
    for (;;) {
      auto it = refs_.find(&c);
      if (it != refs_.end()) {
        return it->second;
      }
      if (locating_.insert(&c).second) {
        break;
      }
      located_.wait(lock);
    }
    lock.unlock();
    Result<TensorRef> ref = LocateChunk(fd, *w.tensor, c, path);
    lock.lock();
    locating_.erase(&c);
    if (ref.ok()) {
      refs_.emplace(&c, *ref);
    }
    located_.notify_all();
    return ref;
  }

  // The file offset of the chunk's data when known without reading (resolved or opened before).
  std::optional<uint64_t> DataOffset(const WorkItem& w) {
    const SourceChunk& c = w.tensor->chunks[w.chunk];
    if (c.resolved) {
      return c.data_offset;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = refs_.find(&c);
    if (it == refs_.end()) {
      return std::nullopt;
    }
    return it->second.data_offset;
  }

 private:
  std::mutex mu_;
  std::condition_variable located_;
  std::map<const SourceChunk*, TensorRef> refs_;
  std::set<const SourceChunk*> locating_;
};

// State shared by the workers of one ExecutePlan.
struct CopyShared {
  std::string src_dir;
  uint64_t window = 0;
  CopyMethod method = CopyMethod::kAuto;
  WriteBehind* write_behind = nullptr;  // null when verifying
  ChunkRefs refs;
  // Cleared the first time the kernel refuses to copy between the checkpoint and the output.
  std::atomic<bool> kernel_copy{true};
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<uint64_t> bytes_kernel{0};
  std::atomic<uint64_t> bytes_gathered{0};
  std::atomic<uint64_t> gathered_writes{0};
};

// One worker's memory: at most two windows in use at once (a source window, mapped or read,
// and the verify compare buffer; or the mapped sources of a gather unit).
struct Piece {
  uint64_t dst;
  const char* src;
  uint64_t bytes;
};
struct ThreadBuffers {
  std::vector<char> buf;
  std::vector<char> cmp;
  MappedRange map;
  // A gather unit's sources, mapped at once, and its runs in output order.
  std::vector<MappedRange> maps;
  std::vector<Piece> pieces;
  std::vector<iovec> iov;
};

// A part of a task: the runs it copies from one source chunk, sorted by src.
struct UnitSource {
  const WorkItem* item = nullptr;
  std::vector<CopyRun> runs;
};

// What a worker pulls: a whole work item, or a gather unit: the runs of several chunks of one
// tensor that land in at most one window of one shard, written together.
struct Task {
  size_t shard = 0;
  uint64_t bytes = 0;
  const WorkItem* item = nullptr;
  std::vector<UnitSource> sources;
};

// Work items in order, scattered ones replaced (at the place of their tensor's first one) by
// gather units of at most `window` bytes of output.
std::vector<Task> BuildTasks(const std::vector<const WorkItem*>& work, uint64_t window,
                             bool gather) {
  auto scattered = [&](const WorkItem* w) {
    return gather && w->runs.size() > 1 && w->bytes / w->runs.size() < kSmallRun;
  };
  using Key = std::pair<size_t, const SourceTensor*>;
  std::map<Key, std::vector<const WorkItem*>> groups;
  for (const WorkItem* w : work) {
    if (scattered(w)) {
      groups[{w->shard, w->tensor}].push_back(w);
    }
  }
  std::vector<Task> tasks;
  for (const WorkItem* w : work) {
    if (!scattered(w)) {
      Task t;
      t.shard = w->shard;
      t.bytes = w->bytes;
      t.item = w;
      tasks.push_back(std::move(t));
      continue;
    }
    auto g = groups.find({w->shard, w->tensor});
    if (g == groups.end()) {
      continue;  // emitted with the group's first item
    }
    struct ItemRun {
      const WorkItem* item;
      CopyRun run;
    };
    std::vector<ItemRun> pieces;
    for (const WorkItem* gw : g->second) {
      for (const CopyRun& r : gw->runs) {
        pieces.push_back({gw, r});
      }
    }
    groups.erase(g);
    std::sort(pieces.begin(), pieces.end(),
              [](const ItemRun& a, const ItemRun& b) { return a.run.dst < b.run.dst; });
    size_t i = 0;
    while (i < pieces.size()) {
      Task t;
      t.shard = w->shard;
      const uint64_t begin = pieces[i].run.dst;
      size_t j = i + 1;
      while (j < pieces.size() && pieces[j].run.dst + pieces[j].run.bytes - begin <= window) {
        ++j;
      }
      std::map<const WorkItem*, std::vector<CopyRun>> by_item;
      for (size_t k = i; k < j; ++k) {
        const CopyRun& r = pieces[k].run;
        by_item[pieces[k].item].push_back(r);
        t.bytes += r.bytes;
      }
      for (auto& [item, runs] : by_item) {
        std::sort(runs.begin(), runs.end(),
                  [](const CopyRun& a, const CopyRun& b) { return a.src < b.src; });
        t.sources.push_back({item, std::move(runs)});
      }
      tasks.push_back(std::move(t));
      i = j;
    }
  }
  return tasks;
}

// One window [start, start + len) of a chunk's data, loaded on first use: mapped (page cache,
// no copy) unless `use_mmap` is false or the file cannot be mapped, else read into tb->buf.
class Window {
 public:
  Window(int fd, uint64_t base, const std::string& path, bool use_mmap, ThreadBuffers* tb,
         std::atomic<uint64_t>* bytes_read)
      : fd_(fd), base_(base), path_(path), use_mmap_(use_mmap), tb_(tb), bytes_read_(bytes_read) {}
  ~Window() { tb_->map.Reset(); }
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  void Reset(uint64_t start, uint64_t len) {
    start_ = start;
    len_ = len;
    data_ = nullptr;
    mapped_ = false;
    tb_->map.Reset();
  }

  // The byte at `src` (inside the window) of the chunk's data.
  Result<const char*> At(uint64_t src) {
    if (data_ == nullptr) {
      BRAGG_RETURN_IF_ERROR(Load());
    }
    return data_ + (src - start_);
  }

  // Whether the `n` bytes at `src` (inside the window) equal `other`. A mapped window reads
  // under MappedRange::Equals's guard: a file truncated meanwhile is an error, not SIGBUS.
  Result<bool> Equals(uint64_t src, const char* other, uint64_t n) {
    BRAGG_ASSIGN_OR_RETURN(const char* p, At(src));
    if (mapped_) {
      return tb_->map.Equals(src - start_, other, n, path_);
    }
    return std::memcmp(p, other, n) == 0;
  }

 private:
  Status Load() {
    if (use_mmap_) {
      auto m = MappedRange::Map(fd_, base_ + start_, len_, path_);
      if (m.ok()) {
        tb_->map = std::move(*m);
        data_ = tb_->map.data();
        mapped_ = true;
        bytes_read_->fetch_add(len_, std::memory_order_relaxed);
        return absl::OkStatus();
      }
      if (absl::IsInvalidArgument(m.status())) {
        return m.status();
      }
      // A file system without mmap support, or no address space: read instead.
      spdlog::debug("{}; reading instead", std::string(m.status().message()));
      use_mmap_ = false;
    }
    if (tb_->buf.size() < len_) {
      tb_->buf.resize(len_);
    }
    BRAGG_RETURN_IF_ERROR(PreadAll(fd_, tb_->buf.data(), len_, base_ + start_, path_));
    bytes_read_->fetch_add(len_, std::memory_order_relaxed);
    data_ = tb_->buf.data();
    mapped_ = false;
    return absl::OkStatus();
  }

  int fd_;
  uint64_t base_;
  const std::string& path_;
  bool use_mmap_;
  ThreadBuffers* tb_;
  std::atomic<uint64_t>* bytes_read_;
  uint64_t start_ = 0;
  uint64_t len_ = 0;
  const char* data_ = nullptr;
  bool mapped_ = false;  // data_ points into tb_->map (else into tb_->buf)
};

// Walks `runs` (sorted by src, offsets in a chunk's data of `data_bytes` bytes at `base` of
// `fd`) in windows of at most `window` bytes, calling part(piece) for the piece of every run
// inside the current window (`win` is reset to it). The disk reads the next window meanwhile:
// page cache, reclaimable, not memory of this process.
template <typename Fn>
Status WalkWindows(std::vector<CopyRun> runs, uint64_t data_bytes, uint64_t window, Window* win,
                   int fd, uint64_t base, const std::string& path, Fn&& part) {
  size_t i = 0;
  while (i < runs.size()) {
    const uint64_t wstart = runs[i].src;
    const uint64_t wend = wstart + window;
    uint64_t read_end = wstart;
    size_t j = i;
    for (; j < runs.size() && runs[j].src < wend; ++j) {
      read_end = std::max(read_end, std::min(wend, runs[j].src + runs[j].bytes));
    }
    if (read_end > data_bytes) {
      return absl::InvalidArgumentError(fmt::format("{}: run past the end of chunk", path));
    }
    win->Reset(wstart, read_end - wstart);
    if (read_end < data_bytes) {
      (void)::posix_fadvise(fd, static_cast<off_t>(base + read_end),
                            static_cast<off_t>(std::min(window, data_bytes - read_end)),
                            POSIX_FADV_WILLNEED);
    }
    size_t next = j;
    for (size_t k = i; k < j; ++k) {
      CopyRun& r = runs[k];
      const uint64_t n = std::min(r.bytes, wend - r.src);
      BRAGG_RETURN_IF_ERROR(part(CopyRun{r.src, r.dst, n}));
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

// Copies (or, when verifying, compares) `runs` of work item `w` to `out`, run by run: inside
// the kernel where the method allows and the run is large, else from the window.
Status CopyRuns(const WorkItem& w, const std::vector<CopyRun>& runs, int out_fd,
                const std::string& out, CopyShared* sh, ThreadBuffers* tb) {
  const bool verify = sh->write_behind == nullptr;
  const SourceChunk& c = w.tensor->chunks[w.chunk];
  const std::string path = sh->src_dir + "/" + c.file;
  BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
  BRAGG_ASSIGN_OR_RETURN(TensorRef ref, sh->refs.Get(w, fd.get(), path));
  const bool kernel = !verify && sh->method == CopyMethod::kCopyFileRange;
  // A chunk smaller than the window never costs the whole window's memory.
  const uint64_t window = std::min<uint64_t>(sh->window, ref.bytes > 0 ? ref.bytes : 1);
  Window win(fd.get(), ref.data_offset, path, sh->method != CopyMethod::kPread, tb,
             &sh->bytes_read);
  return WalkWindows(
      runs, ref.bytes, window, &win, fd.get(), ref.data_offset, path,
      [&](const CopyRun& r) -> Status {
        if (verify) {
          tb->cmp.resize(r.bytes);
          BRAGG_RETURN_IF_ERROR(PreadAll(out_fd, tb->cmp.data(), r.bytes, r.dst, out));
          BRAGG_ASSIGN_OR_RETURN(bool same, win.Equals(r.src, tb->cmp.data(), r.bytes));
          if (!same) {
            return absl::DataLossError(
                fmt::format("verify: {} bytes at {} of {} differ from {} chunk [{}]", r.bytes,
                            r.dst, out, w.tensor->key, fmt::join(c.offsets, ",")));
          }
          return absl::OkStatus();
        }
        uint64_t done = 0;
        if (kernel && r.bytes >= kMinKernelCopy &&
            sh->kernel_copy.load(std::memory_order_relaxed)) {
          BRAGG_ASSIGN_OR_RETURN(done, CopyFileRangeAll(fd.get(), ref.data_offset + r.src, out_fd,
                                                        r.dst, r.bytes, path, out));
          sh->bytes_kernel.fetch_add(done, std::memory_order_relaxed);
          sh->bytes_read.fetch_add(done, std::memory_order_relaxed);
          if (done < r.bytes && sh->kernel_copy.exchange(false)) {
            spdlog::info("copy_file_range cannot copy from {} to {}: copying through mappings",
                         path, out);
          }
        }
        if (done < r.bytes) {
          BRAGG_ASSIGN_OR_RETURN(const char* p, win.At(r.src + done));
          BRAGG_RETURN_IF_ERROR(PwriteAll(out_fd, p, r.bytes - done, r.dst + done, out));
        }
        return sh->write_behind->Wrote(out_fd, out, w.shard, r.dst, r.bytes);
      });
}

// Writes a gather unit straight from mappings of each source chunk's part with pwritev: every
// merged span of the output is one call (up to IOV_MAX runs), one copy per byte, no buffer. The
// mappings together hold at most one window (as much as the unit's output when the sources are
// dense); a unit whose sources are sparser than that (or one row larger than a window), or
// whose chunks cannot be mapped, is copied run by run through windows instead.
Status RunUnit(const Task& t, int out_fd, const std::string& out, CopyShared* sh,
               ThreadBuffers* tb) {
  uint64_t span_bytes = 0;
  for (const UnitSource& s : t.sources) {
    uint64_t hi = 0;
    for (const CopyRun& r : s.runs) {
      hi = std::max(hi, r.src + r.bytes);
    }
    span_bytes += hi - s.runs.front().src;
  }
  bool mapped = span_bytes <= sh->window;
  tb->pieces.clear();
  for (size_t k = 0; mapped && k < t.sources.size(); ++k) {
    const UnitSource& s = t.sources[k];
    const WorkItem& w = *s.item;
    const std::string path = sh->src_dir + "/" + w.tensor->chunks[w.chunk].file;
    BRAGG_ASSIGN_OR_RETURN(UniqueFd fd, OpenFile(path, O_RDONLY));
    BRAGG_ASSIGN_OR_RETURN(TensorRef ref, sh->refs.Get(w, fd.get(), path));
    const uint64_t lo = s.runs.front().src;
    uint64_t hi = 0;
    for (const CopyRun& r : s.runs) {
      hi = std::max(hi, r.src + r.bytes);
    }
    if (hi > ref.bytes) {
      return absl::InvalidArgumentError(fmt::format("{}: run past the end of chunk", path));
    }
    auto m = MappedRange::Map(fd.get(), ref.data_offset + lo, hi - lo, path);
    if (!m.ok()) {
      if (absl::IsInvalidArgument(m.status())) {
        return m.status();
      }
      spdlog::debug("{}; copying run by run", std::string(m.status().message()));
      mapped = false;
      break;
    }
    sh->bytes_read.fetch_add(hi - lo, std::memory_order_relaxed);
    for (const CopyRun& r : s.runs) {
      tb->pieces.push_back({r.dst, m->data() + (r.src - lo), r.bytes});
    }
    tb->maps.push_back(std::move(*m));
  }
  if (!mapped) {
    tb->maps.clear();
    for (const UnitSource& s : t.sources) {
      BRAGG_RETURN_IF_ERROR(CopyRuns(*s.item, s.runs, out_fd, out, sh, tb));
    }
    return absl::OkStatus();
  }
  std::sort(tb->pieces.begin(), tb->pieces.end(),
            [](const Piece& a, const Piece& b) { return a.dst < b.dst; });
  uint64_t writes = 0;
  size_t i = 0;
  while (i < tb->pieces.size()) {
    const uint64_t off = tb->pieces[i].dst;
    uint64_t len = 0;
    tb->iov.clear();
    for (; i < tb->pieces.size() && tb->iov.size() < IOV_MAX && tb->pieces[i].dst == off + len;
         ++i) {
      tb->iov.push_back({const_cast<char*>(tb->pieces[i].src), tb->pieces[i].bytes});
      len += tb->pieces[i].bytes;
    }
    BRAGG_RETURN_IF_ERROR(PwritevAll(out_fd, tb->iov.data(), tb->iov.size(), off, out));
    BRAGG_RETURN_IF_ERROR(sh->write_behind->Wrote(out_fd, out, t.shard, off, len));
    ++writes;
  }
  tb->maps.clear();
  sh->bytes_gathered.fetch_add(t.bytes, std::memory_order_relaxed);
  sh->gathered_writes.fetch_add(writes, std::memory_order_relaxed);
  return absl::OkStatus();
}

// kAuto: copy_file_range (a reflink on file systems that share extents, a splice from page
// cache to page cache on ext4, a server-side copy on NFS), except into tmpfs, where splicing
// into shmem pages cost more CPU than writing from a mapping (docs/benchmarks.md, reshard).
CopyMethod ResolveCopyMethod(CopyMethod m, const std::string& dst_dir) {
  if (m != CopyMethod::kAuto) {
    return m;
  }
  struct statfs fs;
  if (::statfs(dst_dir.c_str(), &fs) == 0 && fs.f_type == TMPFS_MAGIC) {
    return CopyMethod::kMmap;
  }
  return CopyMethod::kCopyFileRange;
}

// Asks the kernel to read the start of a task's source data into the page cache, so that the
// disk works on the next task while this one is copied. Advisory: errors are ignored (the
// task's own read reports them).
void PrefetchTask(const Task& t, CopyShared* sh) {
  auto advise = [&](const WorkItem& w, const std::vector<CopyRun>& runs, uint64_t bytes) {
    const SourceChunk& c = w.tensor->chunks[w.chunk];
    auto fd = OpenFile(sh->src_dir + "/" + c.file, O_RDONLY);
    if (!fd.ok()) {
      return;
    }
    std::optional<uint64_t> base = sh->refs.DataOffset(w);
    const uint64_t start = base ? *base + (runs.empty() ? 0 : runs.front().src) : c.archive_offset;
    const uint64_t len = base ? bytes : c.archive_length;
    (void)::posix_fadvise(fd->get(), static_cast<off_t>(start),
                          static_cast<off_t>(std::min(len, sh->window)), POSIX_FADV_WILLNEED);
  };
  if (t.item != nullptr) {
    advise(*t.item, t.item->runs, t.item->bytes);
    return;
  }
  for (const UnitSource& s : t.sources) {
    if (!s.runs.empty()) {
      advise(*s.item, s.runs, s.runs.back().src + s.runs.back().bytes - s.runs.front().src);
    }
  }
}

Status CopyConfigFiles(const std::string& from, const std::string& to) {
  UniqueDir d(::opendir(from.c_str()));
  if (d == nullptr) {
    return ErrnoError("opendir", from);
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d.get())) {
    std::string n = e->d_name;
    if (n == "." || n == ".." || n.find(".safetensors") != std::string::npos ||
        n.find(".bin") != std::string::npos || n.find(".tmp") != std::string::npos) {
      continue;
    }
    names.push_back(n);
  }
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

// Whether `path` is shard `s` of this run, complete: its size and its header, which carries the
// run id, are the plan's. A shard left by another run, even of the same size, is not.
bool IsShardOfThisRun(const std::string& path, const PlannedShard& s) {
  auto fd = OpenFile(path, O_RDONLY);
  struct stat st;
  if (!fd.ok() || ::fstat(fd->get(), &st) != 0 || static_cast<uint64_t>(st.st_size) != s.size) {
    return false;
  }
  std::string head(s.header.size(), '\0');
  return PreadAll(fd->get(), head.data(), head.size(), 0, path).ok() && head == s.header;
}

// Writes the index when every shard of this run is in place; else returns false and names the
// first shard still missing in `*missing`.
Result<bool> WriteIndexIfComplete(const Plan& plan, const std::string& dst, int rank,
                                  std::string* missing) {
  nlohmann::json map = nlohmann::json::object();
  for (const PlannedShard& s : plan.shards) {
    if (!IsShardOfThisRun(dst + "/" + s.file, s)) {
      *missing = s.file;
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
  Status st = WriteAll(fd.get(), index.dump(2) + "\n");
  // On disk before it is visible: a crash must not leave an empty index naming the shards.
  if (st.ok() && ::fsync(fd.get()) != 0) {
    st = ErrnoError("fsync", tmp);
  }
  if (st.ok() && ::rename(tmp.c_str(), final_path.c_str()) != 0) {
    st = ErrnoError("rename", tmp);
  }
  if (!st.ok()) {
    (void)::unlink(tmp.c_str());
    return st;
  }
  return true;
}

// Counts this process's open file descriptors (/proc/self/fd); 0 when that cannot be read.
uint64_t CountOpenFds() {
  UniqueDir d(::opendir("/proc/self/fd"));
  if (d == nullptr) {
    return 0;
  }
  uint64_t n = 0;
  while (dirent* e = ::readdir(d.get())) {
    n += e->d_name[0] != '.';
  }
  return n > 0 ? n - 1 : 0;  // the directory's own descriptor
}

// Every shard of a rank stays open until it is complete, beside each worker's source files (a
// chunk, a gather unit's chunks, a prefetch): raises the soft RLIMIT_NOFILE to the hard one, and
// fails before anything is created when even that is too low.
Status EnsureOpenFileLimit(size_t shards, int threads, size_t unit_sources) {
  struct rlimit rl;
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) {
    return ErrnoError("getrlimit", "RLIMIT_NOFILE");
  }
  if (rl.rlim_cur < rl.rlim_max) {
    struct rlimit raised = rl;
    raised.rlim_cur = rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
      rl = raised;
    }
  }
  const uint64_t open_now = CountOpenFds();
  const uint64_t need =
      open_now + shards + static_cast<uint64_t>(threads) * (unit_sources + 2) + 16;
  if (rl.rlim_cur != RLIM_INFINITY && need > rl.rlim_cur) {
    return absl::FailedPreconditionError(fmt::format(
        "this rank writes {} shards at once and needs about {} open files ({} open now, {} "
        "threads), but RLIMIT_NOFILE is {} (hard limit {}): raise it (ulimit -n), run more "
        "ranks (--world-size) or give a larger --max-shard-size",
        shards, need, open_now, threads, rl.rlim_cur, rl.rlim_max));
  }
  return absl::OkStatus();
}

// Deletes this rank's temporary shard files when the conversion fails: a preallocated one holds
// the shard's full size on disk. Armed only when writing (when verifying, the paths are the
// final shards). Renamed shards are gone from their temporary path, so success deletes nothing.
class TempShardCleanup {
 public:
  TempShardCleanup(const std::vector<std::string>* paths, bool armed)
      : paths_(paths), armed_(armed) {}
  ~TempShardCleanup() {
    if (!armed_) {
      return;
    }
    for (const std::string& p : *paths_) {
      if (!p.empty()) {
        (void)::unlink(p.c_str());
      }
    }
  }
  TempShardCleanup(const TempShardCleanup&) = delete;
  TempShardCleanup& operator=(const TempShardCleanup&) = delete;

 private:
  const std::vector<std::string>* paths_;
  bool armed_;
};

// FNV-1a, 64 bits: the same on every machine, unlike std::hash.
class Fnv64 {
 public:
  void Add(std::string_view s) {
    for (char c : s) {
      h_ = (h_ ^ static_cast<uint8_t>(c)) * 0x100000001b3ull;
    }
    h_ = (h_ ^ 0xFF) * 0x100000001b3ull;  // field separator
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ull;
};

}  // namespace

Status AssignRunId(Plan* plan, const std::string& src_dir) {
  Fnv64 h;
  for (const PlannedShard& s : plan->shards) {
    h.Add(s.file);
    h.Add(s.header);
  }
  std::set<std::string> files;
  for (const WorkItem& w : plan->items) {
    files.insert(w.tensor->chunks[w.chunk].file);
  }
  if (::access((src_dir + "/.metadata").c_str(), F_OK) == 0) {
    files.insert(".metadata");
  }
  for (const std::string& f : files) {
    const std::string path = src_dir + "/" + f;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      return ErrnoError("stat", path);
    }
    // Not st_dev: a shared file system's device number differs from node to node.
    h.Add(fmt::format("{} {} {}.{:09d} {}", f, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec,
                      st.st_ino));
  }
  const std::string id = fmt::format("{:016x}", h.value());
  const std::string from = fmt::format("\"bragg_run_id\":\"{}\"", plan->run_id);
  const std::string to = fmt::format("\"bragg_run_id\":\"{}\"", id);
  for (PlannedShard& s : plan->shards) {
    const size_t at = s.header.find(from);
    if (at == std::string::npos || to.size() != from.size()) {
      return absl::InternalError(fmt::format("{}: header without a run id", s.file));
    }
    s.header.replace(at, from.size(), to);
  }
  plan->run_id = id;
  return absl::OkStatus();
}

Result<CopyMethod> ParseCopyMethod(const std::string& name) {
  if (name == "auto") {
    return CopyMethod::kAuto;
  }
  if (name == "copy_file_range") {
    return CopyMethod::kCopyFileRange;
  }
  if (name == "mmap") {
    return CopyMethod::kMmap;
  }
  if (name == "pread") {
    return CopyMethod::kPread;
  }
  return absl::InvalidArgumentError(
      fmt::format("--copy-method {}: give auto, copy_file_range, mmap or pread", name));
}

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
  if (!o.verify) {
    // An index left by an earlier run names shards that this run replaces or deletes.
    const std::string index = o.dst_dir + "/model.safetensors.index.json";
    if (::unlink(index.c_str()) != 0 && errno != ENOENT) {
      return ErrnoError("unlink", index);
    }
  }
  if (o.rank == 0 && !o.hf_config_dir.empty() && !o.verify) {
    BRAGG_RETURN_IF_ERROR(CopyConfigFiles(o.hf_config_dir, o.dst_dir));
  }
  const std::vector<size_t> mine = ShardsForRank(plan, o.rank, o.world_size);
  std::vector<bool> owned(plan.shards.size(), false);
  for (size_t s : mine) {
    owned[s] = true;
  }
  std::vector<UniqueFd> fds(plan.shards.size());
  std::vector<std::string> paths(plan.shards.size());
  std::vector<std::atomic<int64_t>> pending(plan.shards.size());
  // Declared after `fds`, so destroyed before them; unlinking an open file is fine.
  TempShardCleanup cleanup(&paths, !o.verify);
  std::unique_ptr<WriteBehind> write_behind =
      o.verify ? nullptr : std::make_unique<WriteBehind>(plan);
  std::vector<const WorkItem*> work;
  for (const WorkItem& w : plan.items) {
    if (owned[w.shard]) {
      work.push_back(&w);
      if (write_behind) {
        for (const CopyRun& r : w.runs) {
          write_behind->Account(w.shard, r.dst, r.bytes);
        }
      }
    }
  }
  // Gathering pays off only where the runs are copied from mappings; verifying compares run by
  // run.
  const std::vector<Task> tasks =
      BuildTasks(work, window, !o.verify && o.copy_method != CopyMethod::kPread);
  for (const Task& t : tasks) {
    pending[t.shard].fetch_add(1);
  }
  size_t unit_sources = 1;
  for (const Task& t : tasks) {
    unit_sources = std::max(unit_sources, t.sources.size());
  }
  BRAGG_RETURN_IF_ERROR(EnsureOpenFileLimit(mine.size(), threads, unit_sources));
  // Open (and preallocate) this rank's shards.
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
  if (write_behind) {
    for (size_t s : mine) {
      const PlannedShard& sh = plan.shards[s];
      write_behind->Account(s, 0, sh.header.size());
      BRAGG_RETURN_IF_ERROR(write_behind->Wrote(fds[s].get(), paths[s], s, 0, sh.header.size()));
    }
  }
  CopyShared sh;
  sh.src_dir = o.src_dir;
  sh.window = window;
  sh.method = ResolveCopyMethod(o.copy_method, o.dst_dir);
  sh.write_behind = write_behind.get();
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
  std::atomic<uint64_t> bytes_done{0};
  std::atomic<bool> failed{false};
  std::atomic<int64_t> last_report_ms{0};
  uint64_t total_work = 0;
  for (const Task& t : tasks) {
    total_work += t.bytes;
  }
  std::mutex mu;
  Status first_error;
  auto worker = [&]() {
    ThreadBuffers tb;
    while (!failed.load()) {
      size_t k = next.fetch_add(1);
      if (k >= tasks.size()) {
        return;
      }
      const Task& t = tasks[k];
      if (k + 1 < tasks.size()) {
        PrefetchTask(tasks[k + 1], &sh);
      }
      Status s = t.item != nullptr
                     ? CopyRuns(*t.item, t.item->runs, fds[t.shard].get(), paths[t.shard], &sh, &tb)
                     : RunUnit(t, fds[t.shard].get(), paths[t.shard], &sh, &tb);
      if (s.ok() && pending[t.shard].fetch_sub(1) == 1) {
        s = finish_shard(t.shard);
      }
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) {
          first_error = s;
        }
        failed = true;
        return;
      }
      uint64_t done = bytes_done.fetch_add(t.bytes) + t.bytes;
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
    return first_error;
  }
  double secs = Since(t0);
  (o.verify ? stats.verify_seconds : stats.copy_seconds) = secs;
  stats.bytes_read = sh.bytes_read.load();
  stats.bytes_kernel_copied = sh.bytes_kernel.load();
  stats.bytes_gathered = sh.bytes_gathered.load();
  stats.gathered_writes = sh.gathered_writes.load();
  stats.bytes_written = o.verify ? 0 : bytes_done.load();
  stats.shards_written = o.verify ? 0 : static_cast<int>(mine.size());
  spdlog::info("{}: {} shards, {:.3f} GB in {:.2f} s ({:.2f} GB/s read)",
               o.verify ? "verify" : "copy", mine.size(), bytes_done.load() / 1e9, secs,
               secs > 0 ? sh.bytes_read.load() / 1e9 / secs : 0.0);
  if (!o.verify) {
    spdlog::info("copy: {:.3f} GB by copy_file_range, {:.3f} GB gathered into {} writes",
                 stats.bytes_kernel_copied / 1e9, stats.bytes_gathered / 1e9,
                 stats.gathered_writes);
  }
  if (!o.verify) {
    BRAGG_ASSIGN_OR_RETURN(stats.index_written,
                           WriteIndexIfComplete(plan, o.dst_dir, o.rank, &stats.index_waits_for));
  }
  return stats;
}

}  // namespace bragg::reshard
