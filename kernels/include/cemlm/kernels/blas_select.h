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

namespace cemlm {

// Set beside OPENBLAS_CORETYPE by reexec_for_openblas_kernels(), so that a choice from the
// environment can be told apart from cemlm's.
inline constexpr char kOpenblasCoretypeChosenEnv[] = "CEMLM_OPENBLAS_CORETYPE_CHOSEN";

// The OPENBLAS_CORETYPE that fits this processor better than `chosen` (the kernels OpenBLAS
// picked, as openblas_get_corename() names them), or "" to keep them: an AVX-512 processor
// (F, BW, DQ, VL) left with generic x86-64 or AVX2 kernels gets Cooperlake's (with AVX512-BF16)
// or SkylakeX's.
std::string better_openblas_core(const std::string& chosen, bool avx512, bool avx512_bf16);

// better_openblas_core() for this processor and the kernels OpenBLAS loaded in this process.
std::string better_openblas_core_here();

// At the start of main(): when OPENBLAS_CORETYPE is unset and better_openblas_core() names other
// kernels for this machine, sets the variable and executes /proc/self/exe with `argv` again.
// Returns only when nothing needs doing or the exec failed (then nothing has changed).
void reexec_for_openblas_kernels(char** argv);

// "OpenBLAS 0.3.21, Cooperlake kernels": what products run on, for benchmark headers and the
// server's start-up log; it adds when OPENBLAS_CORETYPE came from the environment (and which
// kernels would be faster, if any).
std::string blas_description();

}  // namespace cemlm
