// Error checks for the CUDA backend: every CUDA runtime and cuBLAS call, and every kernel launch,
// goes through these. A failure is an invariant violation (like CEMLM_CHECK): it aborts with
// file:line, the failing expression and the library's own message.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define CEMLM_CUDA_CHECK(expr)                                                           \
  do {                                                                                   \
    const cudaError_t cemlm_err_ = (expr);                                               \
    if (cemlm_err_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d: CUDA error %s (%s) in %s\n", __FILE__, __LINE__,      \
                   cudaGetErrorName(cemlm_err_), cudaGetErrorString(cemlm_err_), #expr); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

#define CEMLM_CUBLAS_CHECK(expr)                                                 \
  do {                                                                           \
    const cublasStatus_t cemlm_st_ = (expr);                                     \
    if (cemlm_st_ != CUBLAS_STATUS_SUCCESS) {                                    \
      std::fprintf(stderr, "%s:%d: cuBLAS error %s in %s\n", __FILE__, __LINE__, \
                   cublasGetStatusString(cemlm_st_), #expr);                     \
      std::abort();                                                              \
    }                                                                            \
  } while (0)

// After a <<<...>>> launch: catches bad launch configurations at the launch site.
#define CEMLM_CUDA_LAUNCH_CHECK() CEMLM_CUDA_CHECK(cudaGetLastError())
