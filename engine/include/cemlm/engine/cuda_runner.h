// The CUDA model runner: the ModelRunner of cpu_model.h's forward pass on one GPU, with weights
// uploaded once (bf16 matrices for serving, fp32 for parity), the paged KV cache in device
// memory, CUDA graphs replaying repeated decode steps, and on-device sampling. Built only with
// CEMLM_HAVE_CUDA, wrapped in the libcemlm_cuda.so plugin that make_model_runner loads for --device cuda[:bf16|:fp32].
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cemlm/engine/model_runner.h"
#include "cemlm/engine/params.h"
#include "cemlm/kernels/cuda/sampling.h"

namespace cemlm {

enum class CudaPrecision {
  kBf16,  // weight matrices and their inputs in bf16, fp32 accumulation and activations
  kFp32,  // everything fp32 (no TF32): matches the CPU oracle to float rounding
};

struct CudaRunnerOptions {
  CudaPrecision precision = CudaPrecision::kBf16;
  int64_t kv_cache_memory = 256 << 20;  // bytes; 0: 90% of what loading and the buffers leave
  int block_size = 16;
  bool cuda_graphs = true;  // capture decode steps (one token per sequence) and replay them
  int device = 0;
  // The largest step: tokens fed (and logits rows) and sequences. Every working buffer is
  // reserved for it at creation, before the KV cache takes its share; a larger step is a
  // programming error (aborts). The engine passes --max-batch-tokens and --max-running; these
  // defaults suit direct callers (benchmarks, tests).
  int max_batch_tokens = 8192;
  int max_running = 256;
  // Reserve forward_sample's scratch (about 32 bytes a vocabulary entry a row, for max_running
  // rows): benchmarks and tests sample on the device; the engine samples on the host, and leaves
  // that memory to the KV cache.
  bool device_sampling = false;
};

class CudaModelRunner : public ModelRunner {
 public:
  // One forward step, then one token per logits row (the rows `forward` would return, in the
  // same order) sampled on the device; `rows` holds one spec per such row. Needs the runner
  // made with device_sampling (aborts without).
  virtual void forward_sample(const Batch& batch, std::span<const cuda::SampleRowSpec> rows,
                              std::vector<cuda::SampledToken>* out) = 0;
};

// `params` is read during the call only. Errors name the option or resource at fault.
absl::StatusOr<std::unique_ptr<CudaModelRunner>> make_cuda_runner(const ModelConfig& config,
                                                                  ParamStore& params,
                                                                  const CudaRunnerOptions& opts);

// make_model_runner's CUDA branch: device "cuda" or "cuda:bf16" (bf16) or "cuda:fp32".
absl::StatusOr<std::unique_ptr<ModelRunner>> make_cuda_model_runner(const std::string& model_dir,
                                                                    const RunnerOptions& opts);

}  // namespace cemlm
