// OpenBLAS kernel selection (see blas_select.h).
#include "cemlm/kernels/blas_select.h"

#include <strings.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>

extern "C" char* openblas_get_corename(void);
extern "C" char* openblas_get_config(void);

namespace cemlm {

std::string better_openblas_core(const std::string& chosen, bool avx512, bool avx512_bf16) {
  // The generic x86-64 kernels OpenBLAS falls back to for a processor it does not know, and the
  // AVX2 ones it gives AMD's AVX-512 processors it knows (Zen 4 is a "Zen" to 0.3.21).
  static constexpr const char* kBelowAvx512[] = {"prescott", "core2",   "katmai",
                                                 "unknown",  "haswell", "zen"};
  const bool below = std::any_of(std::begin(kBelowAvx512), std::end(kBelowAvx512),
                                 [&](const char* n) { return !strcasecmp(chosen.c_str(), n); });
  if (!below || !avx512) return "";
  return avx512_bf16 ? "Cooperlake" : "SkylakeX";
}

std::string better_openblas_core_here() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return better_openblas_core(openblas_get_corename(), avx512,
                              __builtin_cpu_supports("avx512bf16"));
}

void reexec_for_openblas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;  // the user's choice, or ours from the first run
  const std::string core = better_openblas_core_here();
  if (core.empty()) return;
  setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  setenv(kOpenblasCoretypeChosenEnv, "1", 1);
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");  // no exec: carry on with the kernels loaded
  unsetenv(kOpenblasCoretypeChosenEnv);
}

std::string blas_description() {
  std::string config = openblas_get_config();  // "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY ..."
  const size_t space = config.find(' ', config.find(' ') + 1);
  std::string out = config.substr(0, space) + ", " + openblas_get_corename() + " kernels";
  if (std::getenv("OPENBLAS_CORETYPE") && !std::getenv(kOpenblasCoretypeChosenEnv)) {
    out += " (OPENBLAS_CORETYPE from the environment";
    if (const std::string better = better_openblas_core_here(); !better.empty())
      out += "; unset it for " + better + "'s, faster here";
    out += ")";
  }
  return out;
}

}  // namespace cemlm
