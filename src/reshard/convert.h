#pragma once

// Executes a Plan: preallocated safetensors shards written with positioned writes, each source
// chunk read once in bounded windows, shards renamed into place when complete, the index last.
// Reads and writes overlap: the next window and the next item are prefetched, and each block of
// a shard goes to writeback as soon as it is complete. Contiguous runs are copied inside the
// kernel (copy_file_range) or from a mapping of the source; runs too small for a write of their
// own (column-split tensors) are gathered from every chunk into one buffer per output range.

#include <cstdint>
#include <string>

#include "common/status.h"
#include "reshard/plan.h"

namespace bragg::reshard {

// How the bytes of contiguous runs move from a source chunk to an output shard.
enum class CopyMethod {
  // kMmap into tmpfs (measured cheaper there), else kCopyFileRange.
  kAuto,
  // copy_file_range for runs of 64 KiB and more; falls back to kMmap when the kernel refuses
  // (EXDEV across file systems, EINVAL, ENOSYS, EOPNOTSUPP, ...).
  kCopyFileRange,
  // The source window is mapped (page cache, no copy) and written out with pwrite: one copy.
  kMmap,
  // The source window is read into a buffer and each run written with its own pwrite (two
  // copies; no gathering): the portable path, kept for comparison and for files mmap refuses.
  kPread,
};

// "auto", "copy_file_range", "mmap", "pread". Errors: InvalidArgument naming the choices.
[[nodiscard]] Result<CopyMethod> ParseCopyMethod(const std::string& name);

struct ConvertOptions {
  std::string src_dir;
  std::string dst_dir;
  std::string hf_config_dir;  // config.json, tokenizer files; copied to dst_dir by rank 0
  int threads = 1;
  // Bounds the copy buffers: threads x 2 x window <= budget (window 1 KiB to 64 MiB); fewer
  // threads run when the budget cannot hold `threads` pairs of minimum windows.
  uint64_t mem_budget = 2ull << 30;
  int rank = 0;
  int world_size = 1;
  bool verify = false;
  CopyMethod copy_method = CopyMethod::kAuto;
};

struct ConvertStats {
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  double plan_seconds = 0;
  double copy_seconds = 0;
  double verify_seconds = 0;
  int shards_written = 0;
  uint64_t bytes_kernel_copied = 0;  // by copy_file_range
  uint64_t bytes_gathered = 0;       // of small runs, written through the gather buffers
  uint64_t gathered_writes = 0;      // pwrite calls that wrote those bytes
  bool index_written = false;
  // When the index was not written: the first shard not (yet) in place, left to another rank.
  std::string index_waits_for;
};

// Gives `plan` (built from the checkpoint in `src_dir`) its run id and writes it into every shard
// header ("__metadata__": {"bragg_run_id": ...}). The id is a hash of the shard headers and of
// the name, size, modification time (ns) and inode of .metadata and of every source file the plan
// reads: every rank of one conversion computes the same id without talking to the others, and a
// changed checkpoint or plan gives another one. Ranks and threads do not enter it (output bytes
// do not depend on them); a conversion repeated with unchanged inputs gets the same id and writes
// the same bytes, so its leftover shards are as good as new ones. Call once, before ExecutePlan.
// Errors: the errno error of stat on a source file.
[[nodiscard]] Status AssignRunId(Plan* plan, const std::string& src_dir);

// Converts this rank's shards of `plan` (built from the checkpoint in options.src_dir). Shards are
// written to "<file>.tmp-<rank>" and renamed when complete. Every rank first deletes
// model.safetensors.index.json; the rank that finds every shard of this run in place (size and
// header, with the plan's run id, equal to the plan's) writes it again (atomically) last.
// Thread-safe use: one call at a time per dst_dir and rank. Errors: the errno error of any file
// operation (naming the file), InvalidArgument when mem_budget is below two minimum windows (2 KiB)
// or a chunk's archive does not hold the tensor the metadata promised, DataLoss when --verify finds
// a mismatch.
[[nodiscard]] Result<ConvertStats> ExecutePlan(const Plan& plan, const ConvertOptions& options);

}  // namespace bragg::reshard
