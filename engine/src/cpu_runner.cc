// make_model_runner: loads a checkpoint and serves it with the CPU model over a KV pool sized
// from the memory budget. (The CUDA runner plugs in here when the backend is built.)
#include <omp.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/model_runner.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/plugin.h"

namespace cemlm {
namespace {

class CpuRunner final : public ModelRunner {
 public:
  CpuRunner(Checkpoint ck, int block_size, int64_t n_blocks, int threads, KvDtype kv_dtype,
            WeightDtype weight_dtype)
      : threads_(threads),
        ck_(std::move(ck)),
        weights_(bind_weights(ck_.config, ck_.params)),
        // The checkpoint's copies of the packed weights, most of its bytes, are never read again.
        model_(ck_.config, weights_, /*batch_invariant=*/true, weight_dtype,
               /*release_unread=*/true),
        kv_(ck_.config, block_size, n_blocks, kv_dtype) {}
  const ModelConfig& config() const override { return ck_.config; }
  int block_size() const override { return kv_.block_size(); }
  int64_t num_blocks() const override { return kv_.num_blocks(); }
  void forward(const Batch& batch, std::vector<float>* logits) override {
    // OpenMP's thread count is a per-thread setting and the engine steps on its own thread.
    omp_set_num_threads(threads_);
    model_.forward(batch, kv_, logits);
  }
  void copy_block(int32_t src, int32_t dst) override { kv_.copy_block(src, dst); }
  int64_t kv_bytes_per_token() const override { return kv_.bytes_per_token(); }
  const CpuModel& model() const { return model_; }

 private:
  int threads_;
  Checkpoint ck_;
  Weights weights_;
  CpuModel model_;
  KvPool kv_;
};

}  // namespace

const char* const kDeviceNames =
    "cpu, cpu:fp32, cpu:bf16, cpu:bf16dot, cpu:int8, cpu:int8dot, cuda, cuda:bf16, cuda:fp32";

std::optional<WeightDtype> cpu_weight_dtype(const std::string& device) {
  if (device == "cpu" || device == "cpu:fp32") return WeightDtype::kFp32;
  if (device == "cpu:bf16") return WeightDtype::kBf16;
  if (device == "cpu:bf16dot") return WeightDtype::kBf16Dot;
  if (device == "cpu:int8") return WeightDtype::kInt8;
  if (device == "cpu:int8dot") return WeightDtype::kInt8Dot;
  return std::nullopt;
}

std::string canonical_device(const std::string& device) {
  if (device == "cpu") return "cpu:fp32";
  if (device == "cuda") return "cuda:bf16";
  return device;
}

bool is_cpu_device(const std::string& device) { return cpu_weight_dtype(device).has_value(); }

absl::Status check_runner_options(const RunnerOptions& opts) {
  const bool cuda = opts.device == "cuda" || opts.device == "cuda:bf16" || opts.device == "cuda:fp32";
  if (!cuda && !is_cpu_device(opts.device))
    return absl::InvalidArgumentError(
        absl::StrCat("--device \"", opts.device, "\" is not one of ", kDeviceNames));
  const std::optional<WeightDtype> weights = cpu_weight_dtype(opts.device);
  if (weights && *weights != WeightDtype::kFp32 && !packed_weights_available())
    return absl::InvalidArgumentError(absl::StrCat(
        "--device ", opts.device, ": this build has no AVX-512 kernels, which ",
        opts.device.substr(4), " weights need; use --device cpu (fp32 weights)"));
  if (weights == WeightDtype::kBf16Dot && !bf16_dot_available())
    return absl::InvalidArgumentError(absl::StrCat(
        "--device ", opts.device,
        ": this CPU has no AVX512-BF16 dot products (AMD Zen 4 and later, Intel Cooper Lake "
        "and Sapphire Rapids and later have them); use --device cpu:bf16 (the same weights, "
        "fp32 arithmetic)"));
  if (weights == WeightDtype::kInt8Dot && !int8_dot_available())
    return absl::InvalidArgumentError(absl::StrCat(
        "--device ", opts.device,
        ": this CPU has no AVX512-VNNI dot products (AMD Zen 4 and later, Intel Cascade Lake, "
        "Ice Lake and later have them); use --device cpu:int8 (the same weights, fp32 "
        "arithmetic)"));
  const std::optional<KvDtype> kv_dtype = parse_kv_dtype(opts.kv_cache_dtype);
  if (!kv_dtype)
    return absl::InvalidArgumentError(absl::StrCat("--kv-cache-dtype \"", opts.kv_cache_dtype,
                                                   "\" is not one of fp32, bf16, int8"));
  if (cuda && *kv_dtype != KvDtype::kFp32)
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-cache-dtype \"", opts.kv_cache_dtype,
                     "\": the CUDA runner keeps its KV cache in fp32; use fp32 (bf16 and int8 are "
                     "for --device cpu)"));
  if (const std::string error = threads_flag_error(opts.threads); !error.empty())
    return absl::InvalidArgumentError(error);
  if (opts.block_size < 1 || opts.block_size > 1024)
    return absl::InvalidArgumentError(
        absl::StrCat("block_size ", opts.block_size, " must be in [1, 1024]"));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModelRunner>> make_model_runner(const std::string& model_dir,
                                                               const RunnerOptions& opts) {
  CEMLM_RETURN_IF_ERROR(check_runner_options(opts));
  if (!is_cpu_device(opts.device)) {
    std::string why;
    auto factory = reinterpret_cast<CudaRunnerFactory (*)()>(
        load_plugin_entry("libcemlm_cuda.so", "CEMLM_CUDA_PLUGIN", CEMLM_CUDA_PLUGIN_BUILD_PATH,
                          "cemlm_cuda_runner_factory", /*deep_bind=*/false, &why));
    if (!factory)
      return absl::FailedPreconditionError(absl::StrCat(
          "device \"", opts.device, "\": the CUDA backend plugin libcemlm_cuda.so cannot be loaded (",
          why, "); build with -DCEMLM_CUDA=ON and install it beside cemlm, or use --device cpu"));
    return factory()(model_dir, opts);
  }
  const KvDtype kv_dtype = *parse_kv_dtype(opts.kv_cache_dtype);
  // The budget from config.json alone, before the weights are read (a 4 GB checkpoint took 10 s
  // to load before this was refused).
  CEMLM_ASSIGN_OR_RETURN(const ModelConfig config, load_checkpoint_config(model_dir));
  const int64_t blocks =
      KvPool::blocks_for_budget(config, opts.block_size, opts.kv_cache_memory, kv_dtype);
  CEMLM_RETURN_IF_ERROR(KvPool::check_holds_a_sequence(
      config, opts.block_size, blocks, opts.kv_cache_memory, kv_dtype, "raise --kv-cache-memory"));
  CEMLM_ASSIGN_OR_RETURN(Checkpoint ck, load_checkpoint(model_dir));
  const int threads = use_cpu_threads(opts.threads).threads;
  auto runner = std::make_unique<CpuRunner>(std::move(ck), opts.block_size, blocks, threads,
                                            kv_dtype, *cpu_weight_dtype(opts.device));
  // Else every request would fail on non-finite logits, with no word of the cause at start-up.
  if (const int64_t token = runner->model().first_nonfinite_embedding(); token >= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("'", model_dir, "': ", lev_embedding_error(token).message()));
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace cemlm
