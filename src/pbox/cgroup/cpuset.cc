#include "pbox/cgroup/cpuset.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <numeric>

#include "fmt/format.h"

namespace bragg::pbox {
namespace {

constexpr int kMaxCpu = 65535;

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// Parses one CPU number of `item` (all digits, at most kMaxCpu).
Result<int> ParseCpu(std::string_view digits, std::string_view item) {
  if (digits.empty()) {
    return absl::InvalidArgumentError(
        fmt::format("invalid CPU list item '{}': expected N or N-M", std::string(item)));
  }
  int value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') {
      return absl::InvalidArgumentError(
          fmt::format("invalid CPU list item '{}': '{}' is not a CPU number (expected N or N-M "
                      "with non-negative decimal N, M)",
                      std::string(item), std::string(digits)));
    }
    value = value * 10 + (c - '0');
    if (value > kMaxCpu) {
      return absl::InvalidArgumentError(fmt::format(
          "invalid CPU list item '{}': CPU numbers must be <= {}", std::string(item), kMaxCpu));
    }
  }
  return value;
}

}  // namespace

CpuSet::CpuSet(std::vector<int> cpus) : cpus_(std::move(cpus)) {
  std::sort(cpus_.begin(), cpus_.end());
  cpus_.erase(std::unique(cpus_.begin(), cpus_.end()), cpus_.end());
}

Result<CpuSet> CpuSet::Parse(std::string_view text) {
  while (!text.empty() && IsSpace(text.front())) {
    text.remove_prefix(1);
  }
  while (!text.empty() && IsSpace(text.back())) {
    text.remove_suffix(1);
  }
  if (text.empty()) {
    return CpuSet();
  }
  // Items are kept as ranges and merged at the end: overlapping items ("0-65535,0-65535,...")
  // cost one range each, so time and memory stay linear in the text plus the CPU number range.
  std::vector<std::pair<int, int>> ranges;
  size_t start = 0;
  for (;;) {
    size_t comma = text.find(',', start);
    std::string_view item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (item.empty()) {
      return absl::InvalidArgumentError(fmt::format(
          "invalid CPU list '{}': empty item (expected e.g. \"0-3,8\")", std::string(text)));
    }
    size_t dash = item.find('-');
    if (dash == std::string_view::npos) {
      BRAGG_ASSIGN_OR_RETURN(int cpu, ParseCpu(item, item));
      ranges.emplace_back(cpu, cpu);
    } else {
      BRAGG_ASSIGN_OR_RETURN(int lo, ParseCpu(item.substr(0, dash), item));
      BRAGG_ASSIGN_OR_RETURN(int hi, ParseCpu(item.substr(dash + 1), item));
      if (hi < lo) {
        return absl::InvalidArgumentError(fmt::format(
            "invalid CPU list item '{}': reversed range (write {}-{})", std::string(item), hi, lo));
      }
      ranges.emplace_back(lo, hi);
    }
    if (comma == std::string_view::npos) {
      break;
    }
    start = comma + 1;
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<int> cpus;
  int next = 0;  // the lowest CPU not yet emitted
  for (const auto& [lo, hi] : ranges) {
    for (int c = std::max(lo, next); c <= hi; ++c) {
      cpus.push_back(c);
    }
    next = std::max(next, hi + 1);
  }
  return CpuSet(std::move(cpus));
}

Result<CpuSet> CpuSet::ForThisProcess() {
  // Start at the glibc default size and grow: sched_getaffinity fails with EINVAL when the
  // mask is smaller than the kernel's nr_cpu_ids.
  for (int ncpus = CPU_SETSIZE; ncpus <= 1 << 20; ncpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(ncpus);
    if (set == nullptr) {
      return absl::ResourceExhaustedError("CPU_ALLOC failed");
    }
    size_t bytes = CPU_ALLOC_SIZE(ncpus);
    CPU_ZERO_S(bytes, set);
    if (::sched_getaffinity(0, bytes, set) != 0) {
      int err = errno;
      CPU_FREE(set);
      if (err == EINVAL) {
        continue;
      }
      return ErrnoError("sched_getaffinity", "0", err);
    }
    std::vector<int> cpus;
    for (int c = 0; c < ncpus; ++c) {
      if (CPU_ISSET_S(c, bytes, set)) {
        cpus.push_back(c);
      }
    }
    CPU_FREE(set);
    return CpuSet(std::move(cpus));
  }
  return absl::InternalError("sched_getaffinity: CPU mask larger than 1M CPUs");
}

std::string CpuSet::ToString() const {
  std::string out;
  for (size_t i = 0; i < cpus_.size();) {
    size_t j = i;
    while (j + 1 < cpus_.size() && cpus_[j + 1] == cpus_[j] + 1) {
      ++j;
    }
    if (!out.empty()) {
      out += ',';
    }
    if (j == i) {
      out += std::to_string(cpus_[i]);
    } else {
      out += fmt::format("{}-{}", cpus_[i], cpus_[j]);
    }
    i = j + 1;
  }
  return out;
}

bool CpuSet::Contains(int cpu) const { return std::binary_search(cpus_.begin(), cpus_.end(), cpu); }

bool CpuSet::IsSubsetOf(const CpuSet& other) const {
  return std::includes(other.cpus_.begin(), other.cpus_.end(), cpus_.begin(), cpus_.end());
}

CpuSet CpuSet::Minus(const CpuSet& other) const {
  std::vector<int> out;
  std::set_difference(cpus_.begin(), cpus_.end(), other.cpus_.begin(), other.cpus_.end(),
                      std::back_inserter(out));
  return CpuSet(std::move(out));
}

CpuSet CpuSet::Last(size_t n) const {
  if (n >= cpus_.size()) {
    return *this;
  }
  return CpuSet(std::vector<int>(cpus_.end() - static_cast<std::ptrdiff_t>(n), cpus_.end()));
}

CpuAllocator::CpuAllocator(CpuSet pool) : pool_(std::move(pool)), load_(pool_.size(), 0) {}

Result<CpuSet> CpuAllocator::Allocate(uint32_t n, const CpuSet* within) {
  if (n == 0) {
    n = 1;
  }
  if (pool_.empty()) {
    return absl::FailedPreconditionError(
        "cannot allocate CPUs: the sandbox CPU pool is empty (give the agent CPUs with --cpus)");
  }
  if (n > pool_.size()) {
    return absl::InvalidArgumentError(
        fmt::format("cannot allocate {} CPUs: the sandbox CPU pool {} has only {}", n,
                    pool_.ToString(), pool_.size()));
  }
  std::vector<size_t> order;
  for (size_t i = 0; i < pool_.size(); ++i) {
    if (within == nullptr || within->Contains(pool_.cpus()[i])) {
      order.push_back(i);
    }
  }
  if (n > order.size()) {
    return absl::InvalidArgumentError(
        fmt::format("cannot allocate {} CPUs: the session's CPUs {} hold only {} of the pool {}", n,
                    within->ToString(), order.size(), pool_.ToString()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Least-loaded first; ties go to the lower CPU so that placement is deterministic.
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return load_[a] < load_[b]; });
  std::vector<int> chosen;
  for (size_t i = 0; i < n; ++i) {
    ++load_[order[i]];
    chosen.push_back(pool_.cpus()[order[i]]);
  }
  return CpuSet(std::move(chosen));
}

void CpuAllocator::Release(const CpuSet& cpus) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::vector<int>& pool = pool_.cpus();
  for (int cpu : cpus.cpus()) {
    auto it = std::lower_bound(pool.begin(), pool.end(), cpu);
    if (it == pool.end() || *it != cpu) {
      continue;  // not ours: ignore rather than corrupt another CPU's count
    }
    uint32_t& load = load_[static_cast<size_t>(it - pool.begin())];
    if (load > 0) {
      --load;
    }
  }
}

std::vector<uint32_t> CpuAllocator::Load() const {
  std::lock_guard<std::mutex> lock(mu_);
  return load_;
}

}  // namespace bragg::pbox
