#pragma once

// SplitMix64's finaliser: a fixed, well-mixed 64-bit hash step, the same in every process and
// run (prefix-cache keys, simulated tokens, routed-expert ids and sampling draws rely on that).

#include <cstdint>

namespace bragg {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace bragg
