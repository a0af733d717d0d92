// CudaRunner (see cuda_runner.h): CpuModel::forward's flat per-layer op lists over the
// cemlm::cuda ops. Each step the host packs the row tables (token ids, positions, step sizes,
// logits rows, per-row block-table pointers, block tables) into one pinned buffer and uploads it
// with one copy; kernels read them from fixed device addresses, which is what lets a captured
// decode step (a CUDA graph) replay with new contents. Every working buffer is reserved at
// creation for the largest step (cuda_workspace.h), so no step allocates or moves them.
#include "cemlm/engine/cuda_runner.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/status.h"
#include "cemlm/kernels/cuda/attention.h"
#include "cemlm/kernels/cuda/buffer.h"
#include "cemlm/kernels/cuda/linear.h"
#include "cemlm/kernels/cuda/ops.h"
#include "cemlm/kernels/rope.h"
#include "cuda_workspace.h"

namespace cemlm {
namespace {

using cuda::DeviceBuffer;
using cuda::DeviceWeight;

constexpr size_t kCublasWorkspace = size_t(32) << 20;  // Hopper's recommended size
constexpr size_t kMaxGraphs = 64;

Tensor dview(float* p, int64_t rows, int64_t cols) {
  return Tensor(p, {rows, cols}, Device::kCuda);
}

// Device setup failures (a bad device, a broken driver) as a status for the runner's caller.
absl::Status cuda_status(cudaError_t e, const char* what,
                         absl::StatusCode code = absl::StatusCode::kInternal) {
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();  // forget it, or the next launch check would report it
  return absl::Status(code, absl::StrCat(what, " failed on the GPU: ", cudaGetErrorName(e), " (",
                                         cudaGetErrorString(e), ")"));
}
absl::Status cublas_status(cublasStatus_t e, const char* what) {
  if (e == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, " failed: cuBLAS error ", cublasGetStatusString(e)));
}

struct DevLayer {
  Tensor attn_norm, diag, attn_p, attn_u, attn_v, mlp_norm, mlp_p, mlp_u, mlp_v;
  DeviceWeight wq, wk, wv, wo, w_gate, w_up, w_down;
};

// Host plan of one step, and where each table sits in the staged upload (byte offsets).
struct Step {
  int N = 0, M = 0, Tmax = 1;
  bool decode = true;                           // every sequence feeds one token
  std::vector<int> seq_rows, seq_T, seq_table;  // per sequence: rows, T, offset into tables
  std::vector<int32_t> ids, pos, out_rows, tables;
  std::vector<float> eta;
  CudaStageLayout at;  // where each table sits in the staged upload

  CudaStepShape shape() const { return CudaStepShape{N, M, int64_t(tables.size())}; }

  // Rows still updating at recursion step t: a prefix, as sequences come sorted by T.
  int active(int t) const {
    int n = 0;
    for (size_t s = 0; s < seq_T.size() && seq_T[s] > t; ++s) n += seq_rows[s];
    return n;
  }
  // Everything a captured step's launches depend on; the rest is read from the device.
  std::vector<int> graph_key() const {
    std::vector<int> k = {N, M, Tmax};
    for (int t = 0; t < Tmax; ++t) k.push_back(active(t));
    return k;
  }
};

// Device addresses of a staged step's tables.
struct StepDev {
  const int32_t* ids;
  const int32_t* pos;
  const float* eta;
  const int32_t* out_rows;
  const cuda::AttnRow* rows;
};

class CudaRunner final : public CudaModelRunner {
 public:
  CudaRunner(const ModelConfig& c, const CudaRunnerOptions& o) : cfg_(c), opts_(o) {}
  ~CudaRunner() override;
  absl::Status init(ParamStore& params);

  const ModelConfig& config() const override { return cfg_; }
  int block_size() const override { return opts_.block_size; }
  int64_t num_blocks() const override { return n_blocks_; }
  void forward(const Batch& batch, std::vector<float>* logits) override;
  void forward_sample(const Batch& batch, std::span<const cuda::SampleRowSpec> rows,
                      std::vector<cuda::SampledToken>* out) override;
  void copy_block(int32_t src, int32_t dst) override;

 private:
  absl::Status alloc(DeviceBuffer& b, size_t bytes, const std::string& what,
                     const char* hint = "use a smaller model, or lower --kv-cache-memory (or "
                                        "--max-batch-tokens / --max-running, whose working "
                                        "buffers are reserved first)");
  absl::StatusOr<Tensor> put_f32(const Tensor& host, const std::string& what,
                                 std::vector<DeviceBuffer>& owner);
  absl::StatusOr<DeviceWeight> put_matrix(const Tensor& host, const std::string& what);
  absl::Status upload_weights(ParamStore& params);
  absl::Status upload_embedding(const Weights& w);
  absl::Status setup_device();
  absl::Status reserve_workspace();
  absl::Status check_context_fits();
  absl::Status alloc_kv();

  int run(const Batch& batch);  // returns the number of logits rows left in bufs_[kLogits]
  Step plan(const Batch& batch) const;
  void check_fits(const Step& st) const;
  StepDev stage(const Step& st);
  void run_graph(const Step& st, const StepDev& d);
  void run_layers(const Step& st, const StepDev& d);
  void attention_standard(int l, const Step& st, const StepDev& d);
  void attention_cem(int l, const Step& st, const StepDev& d);
  void mlp_swiglu(int l, const Step& st);
  void mlp_cem(int l, const Step& st, const StepDev& d);
  KvLayerView kv_layer(int l) const;
  float* buf(CudaBuf b) const { return bufs_[b].as<float>(); }

  ModelConfig cfg_;
  CudaRunnerOptions opts_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  DeviceBuffer cublas_ws_;
  ExecCtx ctx_;

  std::vector<DeviceBuffer> weights_;  // owns every device tensor below
  std::vector<DevLayer> layers_;
  Tensor embed_, final_norm_, rope_;
  DeviceWeight head_;

  int64_t n_blocks_ = 0;
  int kw_ = 0, vw_ = 0, cw_ = 0;  // floats per token per layer per pool
  DeviceBuffer kv_k_, kv_v_, kv_c_;

  DeviceBuffer bufs_[kNumBufs];
  DeviceBuffer stage_dev_, sample_scratch_;  // all reserved by init for the largest step
  cuda::PinnedBuffer stage_host_;
  int sample_rows_ = 0;  // rows sample_scratch_ is reserved for
  struct CapturedStep {
    cudaGraphExec_t exec;
    uint64_t last_use;  // graph_uses_ at its last launch
  };
  std::map<std::vector<int>, CapturedStep> graphs_;  // at most kMaxGraphs
  uint64_t graph_uses_ = 0;
  std::set<std::vector<int>> seen_;  // keys run once directly; captured on the second sighting
};

CudaRunner::~CudaRunner() {
  (void)cudaSetDevice(opts_.device);
  if (stream_) (void)cudaStreamSynchronize(stream_);
  for (auto& [key, g] : graphs_) (void)cudaGraphExecDestroy(g.exec);
  if (cublas_) (void)cublasDestroy(cublas_);
  if (stream_) (void)cudaStreamDestroy(stream_);
}

absl::Status CudaRunner::alloc(DeviceBuffer& b, size_t bytes, const std::string& what,
                               const char* hint) {
  const cudaError_t e = b.try_alloc(bytes);
  if (e == cudaSuccess) return absl::OkStatus();
  size_t free_b = 0, total_b = 0;
  (void)cudaMemGetInfo(&free_b, &total_b);
  (void)cudaGetLastError();
  return absl::ResourceExhaustedError(absl::StrCat(
      "allocating ", bytes, " bytes on the GPU for ", what, " failed (", cudaGetErrorString(e),
      "; ", free_b, " of ", total_b, " bytes free); ", hint));
}

absl::StatusOr<Tensor> CudaRunner::put_f32(const Tensor& host, const std::string& what,
                                           std::vector<DeviceBuffer>& owner) {
  if (host.empty()) return Tensor{};
  const size_t bytes = sizeof(float) * size_t(host.numel());
  DeviceBuffer b;
  CEMLM_RETURN_IF_ERROR(alloc(b, bytes, what));
  CEMLM_RETURN_IF_ERROR(cuda_status(
      cudaMemcpyAsync(b.as(), host.data, bytes, cudaMemcpyHostToDevice, stream_),
      "uploading a weight"));
  Tensor d = host;
  d.data = b.as<float>();
  d.device = Device::kCuda;
  owner.push_back(std::move(b));
  return d;
}

absl::StatusOr<DeviceWeight> CudaRunner::put_matrix(const Tensor& host, const std::string& what) {
  CEMLM_CHECK(host.ndim == 2);
  DeviceWeight w;
  w.rows = host.dim(0);
  w.cols = host.dim(1);
  if (opts_.precision == CudaPrecision::kFp32) {
    CEMLM_ASSIGN_OR_RETURN(Tensor t, put_f32(host, what, weights_));
    w.f32 = t.data;
    return w;
  }
  std::vector<DeviceBuffer> staging;
  CEMLM_ASSIGN_OR_RETURN(Tensor t, put_f32(host, what + " (fp32 staging)", staging));
  DeviceBuffer b;
  CEMLM_RETURN_IF_ERROR(alloc(b, sizeof(uint16_t) * size_t(host.numel()), what));
  cuda::to_bf16(ctx_, b.as<uint16_t>(), t.data, host.numel());
  // Before the staging copy is freed.
  CEMLM_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream_), "rounding weights to bf16"));
  w.bf16 = b.as<uint16_t>();
  weights_.push_back(std::move(b));
  return w;
}

absl::Status CudaRunner::upload_embedding(const Weights& w) {
  if (cfg_.embedding == EmbeddingType::kTable) {
    CEMLM_ASSIGN_OR_RETURN(embed_, put_f32(w.embed, "embed.weight", weights_));
  } else {
    // The [V, D] table, computed once on the host as the CPU runner computes it (in double: the
    // two backends embed bit for bit alike), refused as it refuses one that is not finite, then
    // uploaded; the generator's weights never reach the GPU.
    const int64_t V = cfg_.vocab_size, D = cfg_.d_model;
    std::vector<int32_t> all(static_cast<size_t>(V));
    for (int32_t i = 0; i < int32_t(V); ++i) all[size_t(i)] = i;
    std::vector<float> table(size_t(V * D));
    lev_forward_f64(Tensor(table.data(), {V, D}), all.data(), lev_weights(w));
    if (const int64_t bad = first_nonfinite_row(table.data(), V, D); bad >= 0)
      return lev_embedding_error(bad);
    CEMLM_ASSIGN_OR_RETURN(
        embed_, put_f32(Tensor(table.data(), {V, D}), "the LEV embedding table", weights_));
    // Before the host table is freed.
    CEMLM_RETURN_IF_ERROR(
        cuda_status(cudaStreamSynchronize(stream_), "uploading the LEV embedding table"));
  }
  if (!cfg_.tie_output) {
    CEMLM_ASSIGN_OR_RETURN(head_, put_matrix(w.lm_head, "lm_head.weight"));
  } else if (opts_.precision == CudaPrecision::kFp32) {
    head_ = DeviceWeight{embed_.data, nullptr, cfg_.vocab_size, cfg_.d_model};
  } else {
    CEMLM_ASSIGN_OR_RETURN(head_, put_matrix(w.embed, "embed.weight (as the output head)"));
  }
  return absl::OkStatus();
}

absl::Status CudaRunner::upload_weights(ParamStore& params) {
  const Weights w = bind_weights(cfg_, params);
  CEMLM_RETURN_IF_ERROR(upload_embedding(w));
  for (int l = 0; l < cfg_.n_layers; ++l) {
    const LayerWeights& h = w.layers[size_t(l)];
    const std::string p = absl::StrCat("layers.", l, ".");
    DevLayer d;
    for (auto [dst, src, name] : {std::tuple{&d.attn_norm, &h.attn_norm, "attn_norm.weight"},
                                  std::tuple{&d.diag, &h.diag, "attn.diag"},
                                  std::tuple{&d.attn_p, &h.attn_p, "attn.precond.p"},
                                  std::tuple{&d.attn_u, &h.attn_u, "attn.precond.u"},
                                  std::tuple{&d.attn_v, &h.attn_v, "attn.precond.v"},
                                  std::tuple{&d.mlp_norm, &h.mlp_norm, "mlp_norm.weight"},
                                  std::tuple{&d.mlp_p, &h.mlp_p, "mlp.precond.p"},
                                  std::tuple{&d.mlp_u, &h.mlp_u, "mlp.precond.u"},
                                  std::tuple{&d.mlp_v, &h.mlp_v, "mlp.precond.v"}}) {
      CEMLM_ASSIGN_OR_RETURN(*dst, put_f32(*src, p + name, weights_));
    }
    for (auto [dst, src, name] :
         {std::tuple{&d.wq, &h.wq, "attn.wq"}, std::tuple{&d.wk, &h.wk, "attn.wk"},
          std::tuple{&d.wv, &h.wv, "attn.wv"}, std::tuple{&d.wo, &h.wo, "attn.wo"},
          std::tuple{&d.w_gate, &h.w_gate, "mlp.w_gate"}, std::tuple{&d.w_up, &h.w_up, "mlp.w_up"},
          std::tuple{&d.w_down, &h.w_down, "mlp.w_down"}}) {
      if (src->empty()) continue;
      CEMLM_ASSIGN_OR_RETURN(*dst, put_matrix(*src, p + name));
    }
    layers_.push_back(d);
  }
  CEMLM_ASSIGN_OR_RETURN(final_norm_, put_f32(w.final_norm, "final_norm.weight", weights_));
  std::vector<float> rope(size_t(cfg_.max_seq_len) * cfg_.head_dim);
  const Tensor rope_host(rope.data(), {cfg_.max_seq_len, cfg_.head_dim});
  rope_table_init(rope_host, cfg_.rope_theta);
  CEMLM_ASSIGN_OR_RETURN(rope_, put_f32(rope_host, "the RoPE table", weights_));
  // Host sources may go once we return.
  return cuda_status(cudaStreamSynchronize(stream_), "uploading the weights");
}

absl::Status CudaRunner::alloc_kv() {
  kw_ = cfg_.qk_dim();
  vw_ = cfg_.attention == AttentionType::kStandard ? cfg_.qk_dim() : 0;
  cw_ = cfg_.attention == AttentionType::kCem && cfg_.diag != DiagMode::kNone ? cfg_.d_model : 0;
  int64_t budget = opts_.kv_cache_memory;
  if (budget == 0) {  // what the weights and the working buffers (all reserved by now) left
    size_t free_b = 0, total_b = 0;
    CEMLM_RETURN_IF_ERROR(cuda_status(cudaMemGetInfo(&free_b, &total_b), "reading free memory"));
    budget = int64_t(double(free_b) * 0.9);
  }
  const int bs = opts_.block_size;
  // Block ids are int32 (block tables, AttnRow): a larger pool could not be addressed.
  n_blocks_ = std::min<int64_t>(KvPool::blocks_for_budget(cfg_, bs, budget), INT32_MAX);
  CEMLM_RETURN_IF_ERROR(KvPool::check_holds_a_sequence(
      cfg_, bs, n_blocks_, budget, KvDtype::kFp32,
      opts_.kv_cache_memory > 0
          ? "raise --kv-cache-memory"
          : "lower --max-batch-tokens or --max-running (their working buffers are reserved "
            "before the cache takes 90% of what is left)"));
  const size_t slots = size_t(cfg_.n_layers) * size_t(n_blocks_) * size_t(bs);
  for (auto [b, w, name] : {std::tuple{&kv_k_, kw_, "the KV cache keys"},
                            std::tuple{&kv_v_, vw_, "the KV cache values"},
                            std::tuple{&kv_c_, cw_, "the KV cache contexts"}}) {
    if (w == 0) continue;
    CEMLM_RETURN_IF_ERROR(alloc(*b, sizeof(float) * slots * size_t(w), name));
    CEMLM_RETURN_IF_ERROR(
        cuda_status(cudaMemsetAsync(b->as(), 0, b->bytes(), stream_), "clearing the KV cache"));
  }
  return absl::OkStatus();
}

absl::Status CudaRunner::setup_device() {
  CEMLM_RETURN_IF_ERROR(cuda_status(cudaSetDevice(opts_.device),
                                    absl::StrCat("selecting CUDA device ", opts_.device).c_str(),
                                    absl::StatusCode::kFailedPrecondition));
  // The attention kernel keeps a block's query, diagonal query and sums in shared memory; a
  // model wider than the device allows is refused here, and a wide one opts in now, not mid-step.
  const cuda::AttentionSmem smem = cuda::paged_attention_prepare(
      cfg_.head_dim, cfg_.d_model, diag_kind(cfg_) != DiagKind::kNone);
  if (smem.error)
    return absl::FailedPreconditionError(
        absl::StrCat("preparing the attention kernel failed on the GPU: ", smem.error));
  if (!smem.fits())
    return absl::InvalidArgumentError(absl::StrCat(
        "d_model ", cfg_.d_model, " and head_dim ", cfg_.head_dim, " need ",
        smem.dynamic_bytes + smem.static_bytes,
        " bytes of shared memory per attention block; this GPU allows ", smem.device_limit));
  CEMLM_RETURN_IF_ERROR(cuda_status(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                                    "creating a CUDA stream"));
  if (cublasCreate(&cublas_) != CUBLAS_STATUS_SUCCESS) {
    cublas_ = nullptr;
    return absl::InternalError("cuBLAS could not be initialised on the GPU; check the driver");
  }
  // Bind once, then give the workspace (binding resets it): captured products must not allocate.
  CEMLM_RETURN_IF_ERROR(cublas_status(cublasSetStream(cublas_, stream_), "cublasSetStream"));
  CEMLM_RETURN_IF_ERROR(alloc(cublas_ws_, kCublasWorkspace, "the cuBLAS workspace"));
  CEMLM_RETURN_IF_ERROR(cublas_status(
      cublasSetWorkspace(cublas_, cublas_ws_.as(), cublas_ws_.bytes()), "cublasSetWorkspace"));
  CEMLM_RETURN_IF_ERROR(cublas_status(
      cublasSetMathMode(cublas_, opts_.precision == CudaPrecision::kFp32 ? CUBLAS_PEDANTIC_MATH
                                                                         : CUBLAS_DEFAULT_MATH),
      "cublasSetMathMode"));
  ctx_.device = Device::kCuda;
  ctx_.cuda_stream = stream_;
  ctx_.cublas = cublas_;
  return absl::OkStatus();
}

// Every working buffer, for the largest step the options allow, before the KV cache is sized:
// a step never allocates, and buffers never move (captured graphs stay valid).
absl::Status CudaRunner::reserve_workspace() {
  const CudaWorkspace w = cuda_workspace_bytes(cfg_, opts_.precision, cuda_worst_step(cfg_, opts_));
  sample_rows_ = opts_.device_sampling ? cuda_sample_rows(cfg_, opts_) : 0;
  const size_t sample_bytes =
      opts_.device_sampling
          ? sizeof(float) *
                size_t(std::max<int64_t>(cuda::sample_rows_max_scratch_floats(
                                             sample_rows_, cfg_.vocab_size, cfg_.max_seq_len),
                                         1))
          : 0;
  const std::string limits =
      absl::StrCat("--max-batch-tokens ", opts_.max_batch_tokens, " and --max-running ",
                   opts_.max_running);
  const std::string hint =
      absl::StrCat("lower --max-batch-tokens (", opts_.max_batch_tokens, ") or --max-running (",
                   opts_.max_running, ")");
  size_t free_b = 0, total_b = 0;
  CEMLM_RETURN_IF_ERROR(cuda_status(cudaMemGetInfo(&free_b, &total_b), "reading free memory"));
  const size_t device_total = w.device_bytes() + sample_bytes;
  if (device_total > free_b)
    return absl::ResourceExhaustedError(absl::StrCat(
        "the working buffers for ", limits, " need ", device_total, " bytes of GPU memory (",
        w.buf_bytes[kLogits], " for the logits alone) but ", free_b, " of ", total_b,
        " are free after loading the weights; ", hint));
  for (int b = 0; b < kNumBufs; ++b)
    CEMLM_RETURN_IF_ERROR(alloc(bufs_[b], w.buf_bytes[size_t(b)],
                                absl::StrCat("the ", cuda_buf_name(b), " buffer (", limits, ")"),
                                hint.c_str()));
  CEMLM_RETURN_IF_ERROR(alloc(stage_dev_, w.stage_bytes,
                              absl::StrCat("the step tables (", limits, ")"), hint.c_str()));
  if (sample_bytes > 0)
    CEMLM_RETURN_IF_ERROR(alloc(sample_scratch_, sample_bytes,
                                absl::StrCat("the sampler's scratch (", sample_rows_, " rows)"),
                                hint.c_str()));
  const cudaError_t e = stage_host_.try_reserve(w.stage_bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::ResourceExhaustedError(absl::StrCat(
        "allocating ", w.stage_bytes, " bytes of pinned host memory for the step tables (", limits,
        ") failed (", cudaGetErrorString(e), "); ", hint));
  }
  ctx_.scratch = buf(kScratch);
  ctx_.scratch_floats = int64_t(bufs_[kScratch].bytes() / sizeof(float));
  return absl::OkStatus();
}

absl::Status CudaRunner::check_context_fits() {
  size_t free_b = 0, total_b = 0;
  CEMLM_RETURN_IF_ERROR(cuda_status(cudaMemGetInfo(&free_b, &total_b), "reading free memory"));
  const int bs = opts_.block_size;
  const int64_t bytes = (cfg_.max_seq_len + bs - 1) / bs * bs * cfg_.kv_bytes_per_token();
  const bool given = opts_.kv_cache_memory > 0;
  const int64_t room = given ? opts_.kv_cache_memory : int64_t(total_b);
  if (bytes <= room) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("one max_seq_len (", cfg_.max_seq_len, ") sequence's KV cache needs ", bytes,
                   " bytes, more than ", given ? "--kv-cache-memory" : "the device's memory", " (",
                   room, " bytes); ", given ? "raise --kv-cache-memory, or " : "",
                   "check max_seq_len in the model's config.json"));
}

absl::Status CudaRunner::init(ParamStore& params) {
  CEMLM_RETURN_IF_ERROR(setup_device());
  // Before the weights: the RoPE table upload_weights builds (max_seq_len x head_dim floats, on
  // the host and the device) is never larger than that cache, so a config that claims millions of
  // positions is refused here rather than after allocating tens of GiB for the table.
  CEMLM_RETURN_IF_ERROR(check_context_fits());
  CEMLM_RETURN_IF_ERROR(upload_weights(params));
  CEMLM_RETURN_IF_ERROR(reserve_workspace());
  CEMLM_RETURN_IF_ERROR(alloc_kv());
  return cuda_status(cudaStreamSynchronize(stream_), "initialising the runner");
}

KvLayerView CudaRunner::kv_layer(int l) const {
  const int64_t per = n_blocks_ * opts_.block_size;
  KvLayerView v;
  v.k = kv_k_.as<float>() + l * per * kw_;
  v.v = vw_ ? kv_v_.as<float>() + l * per * vw_ : nullptr;
  v.c = cw_ ? kv_c_.as<float>() + l * per * cw_ : nullptr;
  v.block_size = opts_.block_size;
  v.n_heads = cfg_.n_heads;
  v.k_width = kw_;
  v.c_width = cw_;
  return v;
}

void CudaRunner::copy_block(int32_t src, int32_t dst) {
  CEMLM_CHECK(src >= 0 && src < n_blocks_ && dst >= 0 && dst < n_blocks_);
  CEMLM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const size_t bs = size_t(opts_.block_size), per = size_t(n_blocks_) * bs;
  for (auto [b, w] : {std::pair{&kv_k_, kw_}, std::pair{&kv_v_, vw_}, std::pair{&kv_c_, cw_}}) {
    if (!w) continue;
    const size_t layer = sizeof(float) * per * size_t(w), block = sizeof(float) * bs * size_t(w);
    // A copy per layer: one strided cudaMemcpy2D would need the layer's pool (the pitch) under
    // the device's memPitch, 2 GiB, which a large cache passes.
    for (int l = 0; l < cfg_.n_layers; ++l) {
      char* base = b->as<char>() + layer * size_t(l);
      CEMLM_CUDA_CHECK(cudaMemcpyAsync(base + block * size_t(dst), base + block * size_t(src),
                                       block, cudaMemcpyDeviceToDevice, stream_));
    }
  }
}

Step CudaRunner::plan(const Batch& batch) const {
  const int V = cfg_.vocab_size, bs = opts_.block_size;
  Step st;
  for (const BatchSeq& s : batch.seqs) {
    CEMLM_CHECK(s.recursion >= 1 && s.n_tokens >= 1 && s.pos_begin >= 0);
    CEMLM_CHECK(st.seq_T.empty() || st.seq_T.back() >= s.recursion);
    CEMLM_CHECK(int64_t(s.n_blocks) * bs >= s.pos_begin + s.n_tokens);
    CEMLM_CHECK(s.pos_begin + s.n_tokens <= cfg_.max_seq_len);
    CEMLM_CHECK(s.tokens != nullptr && s.block_table != nullptr);
    const int used = (s.pos_begin + s.n_tokens + bs - 1) / bs;
    st.seq_table.push_back(int(st.tables.size()));
    for (int b = 0; b < used; ++b) {
      CEMLM_CHECK(s.block_table[b] >= 0 && s.block_table[b] < n_blocks_);
      st.tables.push_back(s.block_table[b]);
    }
    st.seq_rows.push_back(s.n_tokens);
    st.seq_T.push_back(s.recursion);
    st.decode = st.decode && s.n_tokens == 1;
    for (int i = 0; i < s.n_tokens; ++i) {
      CEMLM_CHECK(s.tokens[i] >= 0 && s.tokens[i] < V);
      st.ids.push_back(s.tokens[i]);
      st.pos.push_back(s.pos_begin + i);
      st.eta.push_back(cfg_.step(s.recursion));
    }
    if (s.want_all_logits)
      for (int i = 0; i < s.n_tokens; ++i) st.out_rows.push_back(st.N + i);
    else if (s.want_logits)
      st.out_rows.push_back(st.N + s.n_tokens - 1);
    st.N += s.n_tokens;
  }
  st.M = int(st.out_rows.size());
  if (!st.seq_T.empty()) st.Tmax = st.seq_T.front();
  // The offsets of everything but the tables depend only on N and M, which the graph key holds.
  const CudaStepShape shape = cuda_step_shape(batch, bs);  // what the workspace was sized by
  CEMLM_CHECK(shape.rows == st.N && shape.logits_rows == st.M &&
              shape.table_entries == int64_t(st.tables.size()));
  st.at = cuda_stage_layout(shape);
  return st;
}

// Steps never allocate: init reserved every buffer for the largest step the options allow, so
// one that does not fit is a caller's bug (a batch over max_batch_tokens or max_running).
void CudaRunner::check_fits(const Step& st) const {
  const CudaWorkspace w = cuda_workspace_bytes(cfg_, opts_.precision, st.shape());
  for (int b = 0; b < kNumBufs; ++b) {
    if (w.buf_bytes[size_t(b)] > bufs_[b].bytes())
      std::fprintf(stderr, "CudaRunner: a step of %d rows (%d logits rows) needs %zu bytes of %s; "
                   "%zu were reserved (max_batch_tokens %d)\n",
                   st.N, st.M, w.buf_bytes[size_t(b)], cuda_buf_name(b), bufs_[b].bytes(),
                   opts_.max_batch_tokens);
    CEMLM_CHECK(w.buf_bytes[size_t(b)] <= bufs_[b].bytes());
  }
  CEMLM_CHECK(st.at.bytes <= stage_dev_.bytes());
}

StepDev CudaRunner::stage(const Step& st) {
  char* h = stage_host_.data();
  char* d = stage_dev_.as<char>();
  const size_t n = size_t(st.N);
  std::memcpy(h, st.ids.data(), 4 * n);
  std::memcpy(h + st.at.off_pos, st.pos.data(), 4 * n);
  std::memcpy(h + st.at.off_eta, st.eta.data(), 4 * n);
  if (st.M > 0) std::memcpy(h + st.at.off_out, st.out_rows.data(), 4 * size_t(st.M));
  auto* rows = reinterpret_cast<cuda::AttnRow*>(h + st.at.off_rows);
  const auto* tables = reinterpret_cast<const int32_t*>(d + st.at.off_tables);
  for (size_t s = 0, r = 0; s < st.seq_rows.size(); ++s)
    for (int i = 0; i < st.seq_rows[s]; ++i, ++r)
      rows[r] = cuda::AttnRow{tables + st.seq_table[s], st.pos[r], 0};
  std::memcpy(h + st.at.off_tables, st.tables.data(), 4 * st.tables.size());
  CEMLM_CUDA_CHECK(cudaMemcpyAsync(d, h, st.at.bytes, cudaMemcpyHostToDevice, stream_));
  return StepDev{reinterpret_cast<const int32_t*>(d),
                 reinterpret_cast<const int32_t*>(d + st.at.off_pos),
                 reinterpret_cast<const float*>(d + st.at.off_eta),
                 reinterpret_cast<const int32_t*>(d + st.at.off_out),
                 reinterpret_cast<const cuda::AttnRow*>(d + st.at.off_rows)};
}

void CudaRunner::run_graph(const Step& st, const StepDev& d) {
  const std::vector<int> key = st.graph_key();
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    if (seen_.insert(key).second) {  // first sighting: run directly (this also warms cuBLAS up)
      // A server with many running requests of mixed T sees many shapes: the sightings are
      // forgotten now and then, not the graphs.
      if (seen_.size() > 16 * kMaxGraphs) seen_ = {key};
      run_layers(st, d);
      return;
    }
    if (graphs_.size() >= kMaxGraphs) {  // the graph used longest ago goes
      auto oldest = std::min_element(
          graphs_.begin(), graphs_.end(),
          [](const auto& a, const auto& b) { return a.second.last_use < b.second.last_use; });
      CEMLM_CUDA_CHECK(cudaGraphExecDestroy(oldest->second.exec));
      graphs_.erase(oldest);
    }
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CEMLM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed));
    run_layers(st, d);
    CEMLM_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    CEMLM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CEMLM_CUDA_CHECK(cudaGraphDestroy(graph));
    it = graphs_.emplace(key, CapturedStep{exec, 0}).first;
  }
  it->second.last_use = ++graph_uses_;
  CEMLM_CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream_));
}

int CudaRunner::run(const Batch& batch) {
  CEMLM_CUDA_CHECK(cudaSetDevice(opts_.device));
  const Step st = plan(batch);
  if (st.N == 0) return 0;
  check_fits(st);
  const StepDev d = stage(st);
  if (opts_.cuda_graphs && st.decode)
    run_graph(st, d);
  else
    run_layers(st, d);
  return st.M;
}

void CudaRunner::forward(const Batch& batch, std::vector<float>* logits) {
  const int M = run(batch);
  logits->resize(size_t(M) * size_t(cfg_.vocab_size));
  if (M > 0)
    CEMLM_CUDA_CHECK(cudaMemcpyAsync(logits->data(), buf(kLogits), sizeof(float) * logits->size(),
                                     cudaMemcpyDeviceToHost, stream_));
  CEMLM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // also frees the pinned staging for reuse
}

void CudaRunner::forward_sample(const Batch& batch, std::span<const cuda::SampleRowSpec> rows,
                                std::vector<cuda::SampledToken>* out) {
  const int M = run(batch);
  CEMLM_CHECK(int(rows.size()) == M);
  out->assign(size_t(M), cuda::SampledToken{});
  if (M == 0) {
    CEMLM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  const int V = cfg_.vocab_size;
  // Reserved at init (with device_sampling) for sample_rows_ rows of up to max_seq_len tokens
  // of history each.
  CEMLM_CHECK(opts_.device_sampling && M <= sample_rows_);
  const int64_t need = cuda::sample_rows_scratch_floats(rows.data(), M, V);
  CEMLM_CHECK(sizeof(float) * size_t(need) <= sample_scratch_.bytes());
  ExecCtx sc = ctx_;
  sc.scratch = sample_scratch_.as<float>();
  sc.scratch_floats = need;
  cuda::sample_rows(sc, dview(buf(kLogits), M, V), rows.data(), M, out->data());
}

void CudaRunner::run_layers(const Step& st, const StepDev& d) {
  const int64_t N = st.N, M = st.M, D = cfg_.d_model;
  const Tensor h = dview(buf(kH), N, D);
  cuda::gather_rows(ctx_, h, embed_, d.ids);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    if (cfg_.attention == AttentionType::kCem)
      attention_cem(l, st, d);
    else
      attention_standard(l, st, d);
    if (cfg_.mlp == MlpType::kCem)
      mlp_cem(l, st, d);
    else
      mlp_swiglu(l, st);
  }
  if (M == 0) return;
  const Tensor fin = dview(buf(kFinal), M, D);
  cuda::gather_rows(ctx_, fin, h, d.out_rows);
  cuda::rmsnorm_forward(ctx_, fin, Tensor{}, fin, final_norm_, cfg_.norm_eps);
  cuda::linear_forward(ctx_, dview(buf(kLogits), M, cfg_.vocab_size), fin, head_);
}

void CudaRunner::attention_standard(int l, const Step& st, const StepDev& d) {
  const DevLayer& lw = layers_[size_t(l)];
  const int64_t N = st.N, D = cfg_.d_model, Q = cfg_.qk_dim();
  const Tensor h = dview(buf(kH), N, D), c = dview(buf(kC), N, D), q = dview(buf(kQ), N, Q),
               k = dview(buf(kK), N, Q), v = dview(buf(kV), N, Q), a = dview(buf(kA), N, Q);
  cuda::rmsnorm_forward(ctx_, c, Tensor{}, h, lw.attn_norm, cfg_.norm_eps);
  cuda::linear_forward(ctx_, q, c, lw.wq);
  cuda::linear_forward(ctx_, k, c, lw.wk);
  cuda::linear_forward(ctx_, v, c, lw.wv);
  cuda::rope_forward(ctx_, q, q, d.pos, rope_, false);
  cuda::rope_forward(ctx_, k, k, d.pos, rope_, false);
  const KvLayerView kv = kv_layer(l);
  cuda::kv_write_rows(ctx_, kv, d.rows, st.N, k, v, Tensor{});
  cuda::paged_attention_rows(ctx_, a, Tensor{}, q, Tensor{}, DiagKind::kNone, kv, d.rows, st.N,
                             1.0f / std::sqrt(float(cfg_.head_dim)));
  cuda::linear_forward(ctx_, h, a, lw.wo, 1.0f);
}

void CudaRunner::attention_cem(int l, const Step& st, const StepDev& d) {
  const DevLayer& lw = layers_[size_t(l)];
  const int64_t N = st.N, D = cfg_.d_model, Q = cfg_.qk_dim(), H = cfg_.n_heads;
  const bool diag = cfg_.diag != DiagMode::kNone;
  const DiagKind kind = diag_kind(cfg_);
  const int64_t qd_width = cfg_.diag == DiagMode::kPerHead ? H * D : D;
  const Tensor c = dview(buf(kC), N, D), k = dview(buf(kK), N, Q);
  // The context and the keys come from the sub-layer input, once, whatever T is.
  cuda::rmsnorm_forward(ctx_, c, Tensor{}, dview(buf(kH), N, D), lw.attn_norm, cfg_.norm_eps);
  cuda::linear_forward(ctx_, k, c, lw.wk);
  cuda::rope_forward(ctx_, k, k, d.pos, rope_, false);
  const KvLayerView kv = kv_layer(l);
  cuda::kv_write_rows(ctx_, kv, d.rows, st.N, k, Tensor{}, diag ? c : Tensor{});
  const float scale = 1.0f / std::sqrt(float(cfg_.head_dim));
  for (int t = 0; t < st.Tmax; ++t) {
    const int64_t n = st.active(t);
    const Tensor x = dview(buf(kH), n, D), y = dview(buf(kY), n, D), q = dview(buf(kQ), n, Q),
                 a = dview(buf(kA), n, Q), u = dview(buf(kU), n, D), pu = dview(buf(kPU), n, D),
                 qd = dview(buf(kQD), n, qd_width), oc = dview(buf(kOC), n, qd_width);
    cuda::rmsnorm_forward(ctx_, y, Tensor{}, x, lw.attn_norm, cfg_.norm_eps);
    cuda::linear_forward(ctx_, q, y, lw.wq);
    cuda::rope_forward(ctx_, q, q, d.pos, rope_, false);
    if (diag) cuda::diag_scale_forward(ctx_, qd, y, lw.diag);
    cuda::paged_attention_rows(ctx_, a, diag ? oc : Tensor{}, q, diag ? qd : Tensor{}, kind, kv,
                               d.rows, int(n), scale);
    cuda::rope_forward(ctx_, a, a, d.pos, rope_, true);
    cuda::linear_t_forward(ctx_, u, a, lw.wq);
    if (diag) cuda::diag_gather_forward(ctx_, u, oc, lw.diag);
    if (cfg_.attn_precond_rank > 0)
      cuda::precond_forward(ctx_, pu, u, lw.attn_p, lw.attn_u, lw.attn_v);
    cuda::axpy_rows_forward(ctx_, x, cfg_.attn_precond_rank > 0 ? pu : u, d.eta);
  }
}

void CudaRunner::mlp_swiglu(int l, const Step& st) {
  const DevLayer& lw = layers_[size_t(l)];
  const int64_t N = st.N, D = cfg_.d_model, F = cfg_.d_ff;
  const Tensor h = dview(buf(kH), N, D), c = dview(buf(kC), N, D), g = dview(buf(kG), N, F),
               z = dview(buf(kZ), N, F);
  cuda::rmsnorm_forward(ctx_, c, Tensor{}, h, lw.mlp_norm, cfg_.norm_eps);
  cuda::linear_forward(ctx_, g, c, lw.w_gate);
  cuda::linear_forward(ctx_, z, c, lw.w_up);
  cuda::swiglu_forward(ctx_, z, g, z);
  cuda::linear_forward(ctx_, h, z, lw.w_down, 1.0f);
}

void CudaRunner::mlp_cem(int l, const Step& st, const StepDev& d) {
  const DevLayer& lw = layers_[size_t(l)];
  const int64_t N = st.N, D = cfg_.d_model, F = cfg_.d_ff;
  const Tensor c = dview(buf(kC), N, D), g = dview(buf(kG), N, F);
  // The gate comes from the fixed sub-layer input, once.
  cuda::rmsnorm_forward(ctx_, c, Tensor{}, dview(buf(kH), N, D), lw.mlp_norm, cfg_.norm_eps);
  cuda::linear_forward(ctx_, g, c, lw.w_gate);
  cuda::silu_forward(ctx_, g, g);
  for (int t = 0; t < st.Tmax; ++t) {
    const int64_t n = st.active(t);
    const Tensor x = dview(buf(kH), n, D), y = dview(buf(kY), n, D), z = dview(buf(kZ), n, F),
                 u = dview(buf(kU), n, D), pu = dview(buf(kPU), n, D);
    cuda::rmsnorm_forward(ctx_, y, Tensor{}, x, lw.mlp_norm, cfg_.norm_eps);
    cuda::linear_forward(ctx_, z, y, lw.w_up);
    cuda::mul_forward(ctx_, z, z, dview(buf(kG), n, F));
    cuda::linear_t_forward(ctx_, u, z, lw.w_up);
    if (cfg_.mlp_precond_rank > 0) cuda::precond_forward(ctx_, pu, u, lw.mlp_p, lw.mlp_u, lw.mlp_v);
    cuda::axpy_rows_forward(ctx_, x, cfg_.mlp_precond_rank > 0 ? pu : u, d.eta);
  }
}

int64_t layout_floats(const ModelConfig& c) {
  int64_t n = 0;
  for (const ParamSpec& s : param_layout(c)) n += s.numel();
  return n;
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaModelRunner>> make_cuda_runner(const ModelConfig& config,
                                                                  ParamStore& params,
                                                                  const CudaRunnerOptions& opts) {
  if (opts.block_size < 1 || opts.block_size > 1024)
    return absl::InvalidArgumentError(
        absl::StrCat("block_size ", opts.block_size, " must be in [1, 1024]"));
  if (opts.max_batch_tokens < 1)
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_tokens ", opts.max_batch_tokens, " must be >= 1 (--max-batch-tokens)"));
  if (opts.max_running < 1)
    return absl::InvalidArgumentError(
        absl::StrCat("max_running ", opts.max_running, " must be >= 1 (--max-running)"));
  if (opts.kv_cache_memory < 0)
    return absl::InvalidArgumentError(absl::StrCat(
        "kv_cache_memory ", opts.kv_cache_memory,
        " must be >= 0 bytes (0: 90% of the GPU memory free after loading the weights and "
        "reserving the working buffers)"));
  if (params.size() != layout_floats(config))
    return absl::InvalidArgumentError(absl::StrCat(
        "the parameters hold ", params.size(), " floats but the config's layout needs ",
        layout_floats(config), "; load them with load_checkpoint for this config"));
  int n_dev = 0;
  const cudaError_t e = cudaGetDeviceCount(&n_dev);
  if (e != cudaSuccess || n_dev == 0) {
    (void)cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device is usable (", e == cudaSuccess ? "none found" : cudaGetErrorString(e),
        "); run with --device cpu"));
  }
  if (opts.device < 0 || opts.device >= n_dev)
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device index ", opts.device, " is out of range: ", n_dev, " device(s)"));
  auto runner = std::make_unique<CudaRunner>(config, opts);
  CEMLM_RETURN_IF_ERROR(runner->init(params));
  return std::unique_ptr<CudaModelRunner>(std::move(runner));
}

absl::StatusOr<std::unique_ptr<ModelRunner>> make_cuda_model_runner(const std::string& model_dir,
                                                                    const RunnerOptions& opts) {
  CudaRunnerOptions co;
  if (opts.device == "cuda" || opts.device == "cuda:bf16")
    co.precision = CudaPrecision::kBf16;
  else if (opts.device == "cuda:fp32")
    co.precision = CudaPrecision::kFp32;
  else
    return absl::InvalidArgumentError(
        absl::StrCat("device \"", opts.device, "\" is not one of ", kDeviceNames));
  CEMLM_RETURN_IF_ERROR(check_runner_options(opts));  // the KV cache here is fp32 only
  co.kv_cache_memory = opts.kv_cache_memory;
  co.block_size = opts.block_size;
  co.max_batch_tokens = opts.max_batch_tokens;
  co.max_running = opts.max_running;
  CEMLM_ASSIGN_OR_RETURN(Checkpoint ck, load_checkpoint(model_dir));
  CEMLM_ASSIGN_OR_RETURN(auto runner, make_cuda_runner(ck.config, ck.params, co));
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace cemlm
