// Shared pieces of the GPU tests: a fixture that skips without a device and owns a stream, a
// cuBLAS handle and every device buffer it hands out; host↔device copies; random data; the
// relative error used by the tolerances (max |a − b| over max |b|).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "cemlm/engine/params.h"
#include "cemlm/kernels/cuda/buffer.h"
#include "cemlm/kernels/cuda/check.h"

namespace cemlm::gpu_test {

inline bool have_gpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return ok;
}

// CEMLM_REQUIRE_GPU=1 (set by tests/gpu/run_device_checks.sh) makes a missing device a failure:
// on a lent GPU machine a driver mismatch must not pass as a run of skipped tests.
inline bool gpu_required() {
  const char* v = std::getenv("CEMLM_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}
#define CEMLM_SKIP_WITHOUT_GPU()                                                            \
  do {                                                                                      \
    if (!::cemlm::gpu_test::have_gpu()) {                                                   \
      if (::cemlm::gpu_test::gpu_required())                                                \
        FAIL() << "CEMLM_REQUIRE_GPU=1 but no CUDA device is visible (cudaGetDeviceCount)"; \
      GTEST_SKIP() << "no CUDA device visible (cudaGetDeviceCount)";                        \
    }                                                                                       \
  } while (0)

inline std::vector<float> random_vec(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (float& x : v) x = float(rng.normal()) * scale;
  return v;
}

inline std::vector<int> random_ids(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> ids(static_cast<size_t>(n));
  for (int& t : ids) t = int(rng.next_u64() % uint64_t(vocab));
  return ids;
}

// Largest |a - b| over the largest finite |b|; infinite where one holds a NaN or an infinity the
// other does not hold there (std::max alone drops a NaN difference: all-NaN output passed).
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, mag = 1e-30;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const bool same_special =
        (std::isnan(a[i]) && std::isnan(b[i])) || (std::isinf(a[i]) && a[i] == b[i]);
    if (same_special) continue;
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    diff = std::max(diff, std::fabs(double(a[i]) - b[i]));
    mag = std::max(mag, std::fabs(double(b[i])));
  }
  return diff / mag;
}

template <typename Base = ::testing::Test>
class GpuFixture : public Base {
 protected:
  void SetUp() override {
    CEMLM_SKIP_WITHOUT_GPU();
    CEMLM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CEMLM_CUBLAS_CHECK(cublasCreate(&cublas_));
    CEMLM_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
    ctx_.device = Device::kCuda;
    ctx_.cuda_stream = stream_;
    ctx_.cublas = cublas_;
  }
  void TearDown() override {
    if (stream_) CEMLM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    bufs_.clear();
    if (cublas_) CEMLM_CUBLAS_CHECK(cublasDestroy(cublas_));
    if (stream_) CEMLM_CUDA_CHECK(cudaStreamDestroy(stream_));
  }

  template <typename T>
  T* dev_array(const std::vector<T>& v) {
    bufs_.emplace_back(std::max<size_t>(sizeof(T) * v.size(), 1));
    T* p = bufs_.back().template as<T>();
    // On stream_ and waited for: a plain cudaMemcpy from pageable memory may still be landing
    // when a kernel on a non-blocking stream starts.
    CEMLM_CUDA_CHECK(cudaMemcpyAsync(p, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice,
                                     stream_));
    CEMLM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return p;
  }
  Tensor dev(const std::vector<float>& v, std::initializer_list<int64_t> shape) {
    Tensor t(dev_array(v), shape, Device::kCuda);
    EXPECT_EQ(size_t(t.numel()), v.size());
    return t;
  }
  Tensor zeros(std::initializer_list<int64_t> shape) {
    Tensor t(nullptr, shape, Device::kCuda);
    t.data = dev_array(std::vector<float>(size_t(t.numel()), 0.0f));
    return t;
  }
  std::vector<float> host(const float* p, size_t n) {
    std::vector<float> v(n);
    CEMLM_CUDA_CHECK(
        cudaMemcpyAsync(v.data(), p, sizeof(float) * n, cudaMemcpyDeviceToHost, stream_));
    CEMLM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return v;
  }
  std::vector<float> host(const Tensor& t) { return host(t.data, size_t(t.numel())); }
  void set_scratch(int64_t floats) {
    ctx_.scratch = dev_array(std::vector<float>(size_t(std::max<int64_t>(floats, 1)), 0.0f));
    ctx_.scratch_floats = floats;
  }

  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  ExecCtx ctx_;
  std::vector<cuda::DeviceBuffer> bufs_;
};

}  // namespace cemlm::gpu_test
