// Tensor view and execution context shared by every op. A Tensor never owns memory: ops read
// and write through views so that they never allocate; owners (ParamStore, arenas) live above.
#pragma once
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>

#define CEMLM_CHECK(cond)                                                              \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);    \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)

namespace cemlm {

enum class Device : uint8_t { kCpu, kCuda };

struct Tensor {
  float* data = nullptr;
  std::array<int64_t, 4> shape{0, 0, 0, 0};
  int ndim = 0;
  Device device = Device::kCpu;

  Tensor() = default;
  Tensor(float* d, std::initializer_list<int64_t> dims, Device dev = Device::kCpu)
      : data(d), device(dev) {
    CEMLM_CHECK(dims.size() <= 4);
    for (int64_t s : dims) shape[ndim++] = s;
  }
  int64_t dim(int i) const { return shape[i < 0 ? ndim + i : i]; }
  int64_t numel() const {
    int64_t n = ndim ? 1 : 0;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool empty() const { return data == nullptr; }
  // Row i of the leading dimension, as a view of the remaining dims.
  float* row(int64_t i) const { return data + i * (numel() / shape[0]); }
};

// Everything an op needs besides its tensors. CPU ops use OpenBLAS/OpenMP; CUDA ops the stream.
// `scratch` is caller-owned temporary memory for ops that need it (each op documents how much).
struct ExecCtx {
  Device device = Device::kCpu;
  void* cuda_stream = nullptr;
  void* cublas = nullptr;
  float* scratch = nullptr;
  int64_t scratch_floats = 0;
  // CPU: ops whose summation order could depend on the other rows of the call take the order
  // that does not (paged attention row by row, never as a prefill chunk's sgemm), so that a row's
  // result has the same bits alone or batched. The engine's model sets it; training does not.
  bool batch_invariant = false;
  // CPU paged attention: rows fewer than the threads share their context out over threads, one
  // for every this many bytes of the row's cache at most (a split costs a fork and two barriers;
  // see kernels/cpu/attention.cc). Tests set 1 to split small shapes.
  int64_t attention_split_bytes = 256 << 10;
};

}  // namespace cemlm
