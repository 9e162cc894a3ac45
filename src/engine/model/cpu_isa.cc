#include "engine/model/cpu_isa.h"

#include <strings.h>

#include <cstdio>
#include <cstdlib>

namespace bragg::engine::qwen3 {

bool CpuRuns(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kNone:
      return true;
    case CpuIsa::kAvx2: {
      static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
      return runs;
    }
    case CpuIsa::kAvx512: {
      static const bool runs = __builtin_cpu_supports("avx512f");
      return runs;
    }
  }
  return false;
}

CpuIsa BestCpuIsa() {
  static const CpuIsa best = [] {
    CpuIsa isa = CpuRuns(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                 : CpuRuns(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                          : CpuIsa::kNone;
    const char* most = std::getenv(kCpuIsaVariable);
    if (most == nullptr || *most == '\0') {
      return isa;
    }
    for (CpuIsa cap : {CpuIsa::kNone, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
      if (::strcasecmp(most, CpuIsaName(cap)) == 0) {
        return static_cast<int>(cap) < static_cast<int>(isa) ? cap : isa;
      }
    }
    std::fprintf(stderr, "warning: %s=%s is not one of avx512, avx2, none: ignored\n",
                 kCpuIsaVariable, most);
    return isa;
  }();
  return best;
}

std::vector<CpuIsa> CpuIsas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2}) {
    if (CpuRuns(isa)) {
      isas.push_back(isa);
    }
  }
  return isas;
}

const char* CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kNone:
      break;
  }
  return "none";
}

}  // namespace bragg::engine::qwen3
