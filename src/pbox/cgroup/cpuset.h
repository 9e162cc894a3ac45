#pragma once

// CPU lists in the kernel's format ("0-3,8,10-11") and the allocator that places sandboxes on
// the agent's sandbox CPU set.

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::pbox {

// An ordered set of CPU numbers. Value type.
class CpuSet {
 public:
  CpuSet() = default;
  explicit CpuSet(std::vector<int> cpus);  // sorted, deduplicated

  // Parses "0-3,8" (whitespace and a trailing newline allowed, as cgroupfs prints it).
  // InvalidArgument for anything else: negative numbers, reversed ranges, > 65535.
  static Result<CpuSet> Parse(std::string_view text);
  // The CPUs this process may run on (sched_getaffinity).
  static Result<CpuSet> ForThisProcess();

  std::string ToString() const;  // canonical "0-3,8"; empty set -> ""
  const std::vector<int>& cpus() const { return cpus_; }
  size_t size() const { return cpus_.size(); }
  bool empty() const { return cpus_.empty(); }
  bool Contains(int cpu) const;
  bool IsSubsetOf(const CpuSet& other) const;
  CpuSet Minus(const CpuSet& other) const;
  // The last n CPUs (highest numbers); all of them if n >= size().
  CpuSet Last(size_t n) const;
  bool operator==(const CpuSet& other) const { return cpus_ == other.cpus_; }

 private:
  std::vector<int> cpus_;
};

// Hands out CPUs of the agent's set to sandboxes, least-loaded first, so that sandboxes asking
// for fewer CPUs than the set spread evenly. CPUs are shared, not exclusive: the set may be
// oversubscribed (100 sandboxes on 2 CPUs). Thread-safe.
class CpuAllocator {
 public:
  explicit CpuAllocator(CpuSet pool);

  const CpuSet& pool() const { return pool_; }
  // `n` CPUs (1 if n == 0); InvalidArgument if n > pool size. With `within`, only CPUs of the
  // pool that are also in `within` are candidates (InvalidArgument if fewer than n are).
  Result<CpuSet> Allocate(uint32_t n, const CpuSet* within = nullptr);
  // Returns CPUs from an earlier Allocate.
  void Release(const CpuSet& cpus);
  // Sandboxes currently placed on each CPU of the pool, in pool order.
  std::vector<uint32_t> Load() const;

 private:
  CpuSet pool_;
  mutable std::mutex mu_;
  std::vector<uint32_t> load_;  // parallel to pool_.cpus()
};

}  // namespace bragg::pbox
