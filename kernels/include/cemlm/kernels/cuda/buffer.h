// Owning device and pinned-host allocations for the CUDA backend's owners (runner, tests,
// benchmarks); ops themselves never allocate. Moving transfers ownership; freeing ignores errors
// because it can run during process teardown, after the CUDA runtime has unloaded.
#pragma once
#include <cstddef>
#include <utility>

#include "cemlm/kernels/cuda/check.h"

namespace cemlm::cuda {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // Aborts when the device is out of memory; use try_alloc at edges that report errors.
  explicit DeviceBuffer(size_t bytes) { CEMLM_CUDA_CHECK(try_alloc(bytes)); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  // Replaces the allocation with a fresh one of `bytes` (contents are not kept).
  cudaError_t try_alloc(size_t bytes) {
    reset();
    if (bytes == 0) return cudaSuccess;
    const cudaError_t e = cudaMalloc(&p_, bytes);
    if (e != cudaSuccess) {
      p_ = nullptr;
      (void)cudaGetLastError();  // forget it, or the next launch check would report it
      return e;
    }
    n_ = bytes;
    return cudaSuccess;
  }
  void reset() {
    if (p_) (void)cudaFree(p_);
    p_ = nullptr;
    n_ = 0;
  }
  template <typename T = void>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&&) = delete;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() { reset(); }

  // Grows to at least `bytes` (contents are not kept). Aborts when out of pinned memory; use
  // try_reserve at edges that report errors.
  void reserve(size_t bytes) { CEMLM_CUDA_CHECK(try_reserve(bytes)); }
  cudaError_t try_reserve(size_t bytes) {
    if (bytes <= n_) return cudaSuccess;
    reset();
    const cudaError_t e = cudaMallocHost(&p_, bytes);
    if (e != cudaSuccess) {
      p_ = nullptr;
      (void)cudaGetLastError();
      return e;
    }
    n_ = bytes;
    return cudaSuccess;
  }
  void reset() {
    if (p_) (void)cudaFreeHost(p_);
    p_ = nullptr;
    n_ = 0;
  }
  char* data() const { return static_cast<char*>(p_); }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace cemlm::cuda
