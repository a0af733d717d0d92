// OpenBLAS picks its kernels for the processor as it loads. Version 0.3.21 (Debian 12) predates
// Sapphire Rapids and Emerald Rapids: it finds no match there and falls back to its SSE3
// ("Prescott") kernels, 2–3× slower than its AVX-512 ones (measured on training steps and long
// prefills, docs/BENCHMARKS.md), and the same on AMD's Zen 5. AMD's Zen 4 it takes for a Zen and
// gives its AVX2 ("Haswell") kernels, which on a Zen 5 ran a 512-token prefill 1.5× slower than
// its AVX-512 ones (docs/BENCHMARKS.md, session 7). OPENBLAS_CORETYPE chooses the kernels, but
// only before the library loads, so a program fixes it by executing itself again with the
// variable set; one the user set is left alone.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace cemlm {

// Set beside OPENBLAS_CORETYPE by reexec_with_runtime_env(), so that a choice from the
// environment can be told apart from cemlm's.
inline constexpr char kOpenblasCoretypeChosenEnv[] = "CEMLM_OPENBLAS_CORETYPE_CHOSEN";

// The OPENBLAS_CORETYPE that fits this processor better than `chosen` (the kernels OpenBLAS
// picked, as openblas_get_corename() names them), or "" to keep them: an AVX-512 processor
// (F, BW, DQ, VL) left with generic x86-64 or AVX2 kernels gets Cooperlake's (with AVX512-BF16)
// or SkylakeX's.
std::string better_openblas_core(const std::string& chosen, bool avx512, bool avx512_bf16);

// better_openblas_core() for this processor and the kernels OpenBLAS loaded in this process.
std::string better_openblas_core_here();

// libgomp reads its wait policy as it loads, too. Unset, its threads spin 300,000 rounds (a few
// milliseconds) at every barrier before they sleep: on a machine where another busy process
// shares the cores, a thread that has arrived keeps its core from a partner that has not, and a
// server whose compute threads run niced (--engine-nice) went from 0.09 s to past a 30 s
// deadline for 200 tokens of the default model beside one `yes` (docs/BENCHMARKS.md, session
// 23). cemlm's default, 1,000 rounds (libgomp's own when threads outnumber cores), took 0.6 s
// there and changed nothing on an idle machine; OMP_WAIT_POLICY or GOMP_SPINCOUNT from the
// environment is left alone.
inline constexpr char kOpenmpSpinCount[] = "1000";
// Set beside GOMP_SPINCOUNT when cemlm chose it.
inline constexpr char kOpenmpSpinCountChosenEnv[] = "CEMLM_GOMP_SPINCOUNT_CHOSEN";

// The variables reexec_with_runtime_env() would set here, as (name, value) pairs: OPENBLAS_CORETYPE
// when it is unset and better_openblas_core_here() names other kernels, GOMP_SPINCOUNT when
// neither it nor OMP_WAIT_POLICY is set (each with its marker variable).
std::vector<std::pair<std::string, std::string>> runtime_env_to_set();

// At the start of main(): sets runtime_env_to_set() and executes /proc/self/exe with `argv`
// again. Returns only when nothing needs doing or the exec failed (then nothing has changed).
void reexec_with_runtime_env(char** argv);

// "OpenMP waits: spin 1000 rounds, then sleep (cemlm's default …)": how compute threads wait at
// barriers, and whether the environment chose it, for the server's start-up log.
std::string openmp_wait_description();

// "OpenBLAS 0.3.21, Cooperlake kernels": what products run on, for benchmark headers and the
// server's start-up log; it adds when OPENBLAS_CORETYPE came from the environment (and which
// kernels would be faster, if any).
std::string blas_description();

}  // namespace cemlm
