// The boundary between host bookkeeping (scheduler, block manager, sampler) and compute: one
// engine step hands the runner a batch of sequence chunks whose KV blocks are already allocated;
// the runner writes their keys into the paged cache and returns logits for the rows that want them.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "cemlm/engine/config.h"
#include "cemlm/kernels/linear.h"

namespace cemlm {

struct BatchSeq {
  const int* tokens = nullptr;   // tokens fed this step (a prefill chunk, or one decode token)
  int n_tokens = 0;
  int pos_begin = 0;             // tokens of this sequence already in the cache (= position of tokens[0])
  int recursion = 1;             // T for every CEM sub-layer of this sequence
  const int32_t* block_table = nullptr;  // blocks covering positions [0, pos_begin + n_tokens)
  int n_blocks = 0;
  bool want_logits = false;      // logits of the last fed token (decode, or last prefill chunk)
  bool want_all_logits = false;  // logits of every fed token (scoring)
};

// Sequences must be ordered by `recursion` descending (rows of a step t < T form a prefix).
struct Batch {
  std::vector<BatchSeq> seqs;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int block_size() const = 0;
  virtual int64_t num_blocks() const = 0;
  // Runs one step. `logits` receives, in sequence order, one row [V] per want_logits sequence and
  // n_tokens rows per want_all_logits sequence.
  virtual void forward(const Batch& batch, std::vector<float>* logits) = 0;
  // Copies cached entries of block `src` to block `dst` (copy-on-write for shared prefixes).
  virtual void copy_block(int32_t src, int32_t dst) = 0;
  // Bytes the cache holds per token (all layers), as stored: fp32 unless the runner says otherwise.
  virtual int64_t kv_bytes_per_token() const { return config().kv_bytes_per_token(); }
};

struct RunnerOptions {
  std::string device = "cpu";
  int64_t kv_cache_memory = 256 << 20;
  int block_size = 16;
  int threads = 0;
  std::string kv_cache_dtype = "fp32";  // "fp32" | "bf16" | "int8" (CPU: 1/2, ~1/4 of the bytes)
  // The engine's step limits (--max-batch-tokens, --max-running): the CUDA runner reserves its
  // working buffers for the largest step they allow before sizing the KV cache.
  int max_batch_tokens = 512;
  int max_running = 256;
};

// Checks what needs no checkpoint: the device name, the KV-cache dtype (and that it suits the
// device), the thread count, the block size. Errors name the flag (--device, --kv-cache-dtype,
// --threads).
absl::Status check_runner_options(const RunnerOptions& opts);

// The CUDA runner's factory, as exported by the libcemlm_cuda.so plugin.
using CudaRunnerFactory = absl::StatusOr<std::unique_ptr<ModelRunner>> (*)(
    const std::string& model_dir, const RunnerOptions& opts);

// "cpu", "cpu:fp32", "cpu:bf16", "cpu:bf16dot", "cpu:int8", "cpu:int8dot": the CPU runner over a
// loaded checkpoint (bf16, int8: the product weights held in bf16 or in int8 with block scales,
// half or a quarter of the bytes, computed in fp32; bf16dot, int8dot: the same weights, and the
// products' inputs rounded to bf16 / quantized to int8 too, with dot-product instructions; see
// WeightDtype); "cuda", "cuda:bf16", "cuda:fp32" load the CUDA plugin.
bool is_cpu_device(const std::string& device);
// The weights a CPU device computes with; nullopt for a name that is no CPU device.
std::optional<WeightDtype> cpu_weight_dtype(const std::string& device);
// A device's full name, as ModelInfo reports it: "cpu" is "cpu:fp32" and "cuda" is "cuda:bf16"
// (one configuration, one name on dashboards); other names are returned as given.
std::string canonical_device(const std::string& device);
// Every device name, comma-separated, for the errors that refuse another.
extern const char* const kDeviceNames;
absl::StatusOr<std::unique_ptr<ModelRunner>> make_model_runner(const std::string& model_dir,
                                                               const RunnerOptions& opts);

}  // namespace cemlm
