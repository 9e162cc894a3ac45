#include "common/blas_core.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace bragg {

std::string KnownBlasCore() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) {
    return "";
  }
  return BlasFallbackCore();
}

std::string BlasFallbackCore() {
  // The OpenBLAS this process loaded (torch's, through its own dependencies' scope).
  auto corename = reinterpret_cast<char* (*)()>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (corename == nullptr || corename() == nullptr) {
    return "";
  }
  std::string core = corename();
  std::transform(core.begin(), core.end(), core.begin(),
                 [](unsigned char ch) { return std::tolower(ch); });
  if (core != "prescott") {
    return "";
  }
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512cd")) {
    return __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return "Haswell";
  }
  return "";
}

void ReexecForKnownBlasCore(char** argv) {
  const std::string core = KnownBlasCore();
  if (core.empty()) {
    return;
  }
  ::setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  ::execv("/proc/self/exe", argv);
  // Runs on with the kernels it has; the variable stays for any child.
  std::fprintf(stderr,
               "OpenBLAS runs its Prescott kernels on this CPU; restarting with "
               "OPENBLAS_CORETYPE=%s failed: %s\n",
               core.c_str(), std::strerror(errno));
}

}  // namespace bragg
