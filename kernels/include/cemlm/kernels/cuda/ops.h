// CUDA versions of the row-wise ops (rmsnorm.h, rope.h, elementwise.h, precond.h) with the CPU
// signatures, in namespace cemlm::cuda. Every Tensor must be device memory marked
// Device::kCuda, and raw pointer arguments (pos, eta, ids, rows) are device pointers too. Work is
// queued on ctx.cuda_stream (a cudaStream_t); nothing synchronizes. CUDA: kernels/cuda/*.cu;
// tests: tests/gpu/ops_test.cc. Include only from code built when CEMLM_HAVE_CUDA.
#pragma once
#include <cstdint>

#include "cemlm/kernels/tensor.h"

namespace cemlm::cuda {

void rmsnorm_forward(const ExecCtx&, Tensor out, Tensor rstd, const Tensor& x, const Tensor& gain,
                     float eps);
// `table` is rope_table_init's output copied to the device.
void rope_forward(const ExecCtx&, Tensor out, const Tensor& x, const int32_t* pos,
                  const Tensor& table, bool inverse);

void silu_forward(const ExecCtx&, Tensor out, const Tensor& a);
void swiglu_forward(const ExecCtx&, Tensor out, const Tensor& gate, const Tensor& up);
void mul_forward(const ExecCtx&, Tensor out, const Tensor& a, const Tensor& b);
void axpy_rows_forward(const ExecCtx&, Tensor x, const Tensor& u, const float* eta);
void diag_scale_forward(const ExecCtx&, Tensor qd, const Tensor& y, const Tensor& d);
void diag_gather_forward(const ExecCtx&, Tensor u, const Tensor& oc, const Tensor& d);

// Scratch: 2·N·r floats; needs ctx.cublas (fp32 products).
void precond_forward(const ExecCtx&, Tensor out, const Tensor& u, const Tensor& p, const Tensor& Pu,
                     const Tensor& Pv);

// out[m, :] = src[rows[m], :] (embedding lookup, picking the rows that want logits).
void gather_rows(const ExecCtx&, Tensor out, const Tensor& src, const int32_t* rows);

}  // namespace cemlm::cuda
