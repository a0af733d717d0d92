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

std::vector<std::pair<std::string, std::string>> runtime_env_to_set() {
  std::vector<std::pair<std::string, std::string>> out;
  // Set already: the user's choice, or ours from the first run.
  if (!std::getenv("OPENBLAS_CORETYPE"))
    if (const std::string core = better_openblas_core_here(); !core.empty())
      out.insert(out.end(), {{"OPENBLAS_CORETYPE", core}, {kOpenblasCoretypeChosenEnv, "1"}});
  if (!std::getenv("OMP_WAIT_POLICY") && !std::getenv("GOMP_SPINCOUNT"))
    out.insert(out.end(), {{"GOMP_SPINCOUNT", kOpenmpSpinCount}, {kOpenmpSpinCountChosenEnv, "1"}});
  return out;
}

void reexec_with_runtime_env(char** argv) {
  const auto vars = runtime_env_to_set();
  if (vars.empty()) return;
  for (const auto& [name, value] : vars) setenv(name.c_str(), value.c_str(), 1);
  execv("/proc/self/exe", argv);
  for (const auto& [name, value] : vars) unsetenv(name.c_str());  // no exec: carry on as loaded
}

std::string openmp_wait_description() {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spins = std::getenv("GOMP_SPINCOUNT");
  if (spins && std::getenv(kOpenmpSpinCountChosenEnv))
    return std::string("OpenMP waits: spin ") + spins +
           " rounds, then sleep (cemlm's default; OMP_WAIT_POLICY or GOMP_SPINCOUNT overrides "
           "it)";
  std::string out = "OpenMP waits: ";
  if (policy) out += std::string("OMP_WAIT_POLICY=") + policy + (spins ? ", " : "");
  if (spins) out += std::string("GOMP_SPINCOUNT=") + spins;
  if (!policy && !spins) return out + "libgomp's default (the variables were not passed on)";
  return out + " from the environment";
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
