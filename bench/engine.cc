// bench/engine: serving speed of the CPU runner on a random-init model (`--shape small`, the
// default: D=256, L=4, H=4, d_h=64, F=768, V=4096, 16 MB of fp32 weights for CEM, which a server
// CPU's last-level cache holds; `--shape base`: D=1024, L=12, H=16, d_h=64, F=2816, V=32000,
// 127M parameters for CEM, 218M for standard, beyond it; full CEM with shared diagonal r=8 and
// CEM MLP r=8, and the standard baseline):
// decode tokens/s at batch 1–128 and T = 1, 2, 4 over ~128 tokens of context (and batch 1 over
// 128–1000), prefill tokens/s and time to first token (through the Engine) for a 512-token
// prompt, KV bytes per token, and the two targets as measured ratios (target 1 beside the
// few-row product kernel's rates on hot and on cold weights); and whole-Engine decode
// tokens/s (scheduling and sampling included) for greedy and nucleus sampling. Not a ctest;
// `--quick` for a smoke run.
#include "cemlm/engine/engine.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/model_runner.h"
#include "cemlm/engine/params.h"
#include "cemlm/kernels/linear.h"
#include "machine.h"

namespace {

using namespace cemlm;
using BenchClock = std::chrono::steady_clock;

constexpr int kBlockSize = 16;
constexpr int kContext = 128;     // cached tokens per sequence before the timed decode steps
constexpr int kDecodeSpan = 16;   // decode steps cycle over positions [kContext, kContext + span)
constexpr int kMaxBatch = 128;
constexpr int kLongContext = 1000;  // batch-1 decode at long context (max_seq_len is 1024)
constexpr int kMaxCellContext = 1024 - kDecodeSpan;  // --context: a multiple of the block size

struct Settings {
  std::vector<int> batches{1, 8, 32, 128};
  int prompt = 512;
  double min_seconds = 0.5;  // per decode cell and round
  int rounds = 3;
  int prefill_reps = 2;
  int threads = 0;           // 0: the runner's default (cpu_threads)
  std::string cell;          // "--cell MODEL:T:B": time only that decode cell (for profilers)
  std::string cell_model;
  int cell_T = 0, cell_B = 0;
  int cell_prefill = 0;         // "--prefill-cell MODEL:T:N": a prefill of N tokens instead
  int cell_context = kContext;  // --context: the cell's cached tokens per sequence
  std::string kv_dtype = "fp32";
  std::string device = "cpu";  // a CPU device: the weights' dtype (cpu_weight_dtype)
  std::string shape = "small";
};

struct Shape {
  int vocab, d_model, layers, heads, d_ff;
};
const Shape kSmall{4096, 256, 4, 4, 768}, kBase{32000, 1024, 12, 16, 2816};

ModelConfig bench_config(const Shape& shape, bool cem, int layers) {
  ModelConfig c;
  c.vocab_size = shape.vocab, c.d_model = shape.d_model, c.n_layers = layers;
  c.n_heads = shape.heads, c.head_dim = 64, c.d_ff = shape.d_ff, c.max_seq_len = 1024;
  if (cem) {
    c.attention = AttentionType::kCem, c.diag = DiagMode::kShared, c.attn_precond_rank = 8;
    c.mlp = MlpType::kCem, c.mlp_precond_rank = 8;
  }
  return c;
}

std::vector<int> some_ids(int n, int vocab, int salt) {
  std::vector<int> ids(size_t(n), 0);
  for (int i = 0; i < n; ++i) ids[size_t(i)] = (i * 97 + salt * 31 + 13) % vocab;
  return ids;
}

// A checkpoint on disk, served both by a bare runner and by an Engine.
struct Model {
  std::string name;
  ModelConfig cfg;
  std::string dir;
  std::unique_ptr<ModelRunner> runner;
};

// Room for kMaxBatch decoding sequences plus one prompt, all in disjoint blocks.
int64_t blocks_per_decode_seq(int context = kContext) {
  return (context + kDecodeSpan + kBlockSize - 1) / kBlockSize;
}

// Floating-point operations of one decode token at depth T over n_ctx cached tokens, counted
// from the shapes (2 per multiply-add of every product, attention pass and preconditioner;
// element-wise work left out): what "GFLOP/s" divides by.
double decode_flops(const ModelConfig& c, int T, double n_ctx) {
  const double D = c.d_model, Q = c.qk_dim(), F = c.d_ff, V = c.vocab_size;
  double layer = 0;
  if (c.attention == AttentionType::kStandard) {
    layer += 4 * 2 * D * Q + 2 * 2 * n_ctx * Q;
  } else {
    const double diag = c.diag == DiagMode::kNone ? 0 : c.diag == DiagMode::kShared ? D : c.n_heads * D;
    const double step = 2 * 2 * D * Q + 2 * 2 * n_ctx * (Q + diag) + 4 * 2 * D * c.attn_precond_rank;
    layer += 2 * D * Q + T * step;
  }
  if (c.mlp == MlpType::kSwiglu) layer += 3 * 2 * D * F;
  else layer += 2 * D * F + T * (2 * 2 * D * F + 4 * 2 * D * c.mlp_precond_rank);
  return c.n_layers * layer + 2 * D * V;
}

double seconds_since(BenchClock::time_point t0) {
  return std::chrono::duration<double>(BenchClock::now() - t0).count();
}

// Fastest of at least 3 calls of fn() spanning `min_seconds`, after one warm-up call: the minimum
// rejects the slowdowns of a shared machine, which only ever add time.
template <typename F>
double seconds_per_call(F&& fn, double min_seconds) {
  fn();
  int reps = 0;
  double best = 1e30;
  const auto t0 = BenchClock::now();
  do {
    const auto t = BenchClock::now();
    fn();
    best = std::min(best, seconds_since(t));
    ++reps;
  } while (reps < 3 || seconds_since(t0) < min_seconds);
  return best;
}

// The few-row product kernel's rate at 32 rows on the model's [F, D] MLP weight (in the bench's
// weight dtype), all threads: hot (one weight, in the caches) and cold (copies of it cycled through
// 256 MiB, beyond any last-level cache, as a base-shape decode step streams its weights from
// memory).
struct ProductRates {
  double hot, cold;  // flop/s
};
// On `threads` threads, as the runner's steps (a new thread's OpenMP default is every CPU).
ProductRates product_rates(const ModelConfig& c, const std::string& device, int threads) {
  omp_set_num_threads(threads);
  const int M = 32, N = c.d_ff, K = c.d_model;
  const WeightDtype dtype = *cpu_weight_dtype(device);
  std::vector<float> w(size_t(N) * K, 0.01f), x(size_t(M) * K, 0.5f), y(size_t(M) * N);
  const Tensor W(w.data(), {N, K});
  // The packed weight's bytes (bf16: 2 a number, int8: 1 and its block scales), so that the copies
  // span 256 MiB whatever the dtype.
  const double bytes = dtype == WeightDtype::kFp32                                     ? 4.0
                       : dtype == WeightDtype::kBf16 || dtype == WeightDtype::kBf16Dot ? 2.0
                                                                                       : 1.0;
  const size_t copies =
      std::max<size_t>(2, size_t(double(size_t(256) << 20) / (bytes * double(N) * K)));
  std::vector<PackedLinear> packed;
  packed.reserve(copies);
  for (size_t i = 0; i < copies; ++i) packed.emplace_back(W, PackedLinear::Use::kForward, dtype);
  auto product = [&](const PackedLinear& p) {
    linear_forward(ExecCtx{}, Tensor(y.data(), {M, N}), Tensor(x.data(), {M, K}), p);
  };
  size_t next = 0;
  // The fastest calls, as the step times they are compared with.
  const double hot = seconds_per_call([&] { product(packed[0]); }, 0.5);
  const double cold = seconds_per_call([&] { product(packed[next++ % copies]); }, 0.5);
  const double flops = 2.0 * M * N * K;
  return {flops / hot, flops / cold};
}
// Room for n_seqs decoding sequences at `context` and one prompt.
int64_t kv_budget(const ModelConfig& c, int prompt, int context = kContext,
                  int n_seqs = kMaxBatch) {
  const int64_t blocks =
      n_seqs * blocks_per_decode_seq(context) + (prompt + kBlockSize) / kBlockSize;
  return std::max<int64_t>(blocks, c.max_seq_len / kBlockSize) * kBlockSize * c.kv_bytes_per_token();
}

Model load_model(const std::string& name, const ModelConfig& c, const std::string& root,
                 const Settings& s) {
  Model m{name, c, root + "/" + name, nullptr};
  ParamStore store(c);
  store.init_random(1);
  if (absl::Status st = save_checkpoint(m.dir, c, store); !st.ok()) {
    std::fprintf(stderr, "saving %s: %s\n", m.dir.c_str(), st.ToString().c_str());
    std::exit(1);
  }
  const int64_t budget = s.cell.empty() || s.cell_prefill
                             ? kv_budget(c, s.prompt)
                             : kv_budget(c, s.prompt, s.cell_context, s.cell_B);
  auto r = make_model_runner(m.dir,
                             RunnerOptions{s.device, budget, kBlockSize, s.threads, s.kv_dtype});
  if (!r.ok()) {
    std::fprintf(stderr, "runner for %s: %s\n", name.c_str(), r.status().ToString().c_str());
    std::exit(1);
  }
  m.runner = std::move(r).value();
  return m;
}

// Runs fn() on a thread of its own and returns what it returns. Everything that runs a runner
// directly goes through here: libgomp keeps an OpenMP team for each thread that starts parallel
// regions, and a team left on the main thread beside an Engine's step thread (more threads than
// cores) stops libgomp spinning at the Engine's barriers, which made its decode steps 5–8× slower.
// A thread's team ends with it.
template <typename F>
auto on_own_thread(F&& fn) {
  decltype(fn()) out{};
  std::thread([&] { out = fn(); }).join();
  return out;
}

// Decode timing over per-sequence block tables: sequence i owns a contiguous run of blocks, each
// holding `context` cached tokens (up to n_seqs sequences: kMaxBatch fit the KV budget at kContext).
class DecodeBench {
 public:
  DecodeBench(ModelRunner& r, int T, int context = kContext, int n_seqs = kMaxBatch)
      : r_(r), T_(T), context_(context), nb_(blocks_per_decode_seq(context)) {
    tables_.resize(size_t(n_seqs));
    for (int i = 0; i < n_seqs; ++i)
      for (int64_t b = 0; b < nb_; ++b) tables_[size_t(i)].push_back(int32_t(i * nb_ + b));
    // One real prefill of the context at T; the other sequences get copies of its blocks.
    const std::vector<int> ctx = some_ids(context, r.config().vocab_size, T);
    BatchSeq s{ctx.data(), context, 0, T, tables_[0].data(), int(nb_), false, false};
    std::vector<float> logits;
    r_.forward(Batch{{s}}, &logits);
    for (int i = 1; i < n_seqs; ++i)
      for (int b = 0; b < context / kBlockSize; ++b)
        r_.copy_block(tables_[0][size_t(b)], tables_[size_t(i)][size_t(b)]);
  }
  // Seconds per engine step decoding one token for each of B sequences.
  double step_seconds(int B, double min_seconds) {
    std::vector<int> tokens(static_cast<size_t>(B));
    for (int i = 0; i < B; ++i) tokens[size_t(i)] = (i * 131 + 7) % r_.config().vocab_size;
    int step = 0;
    std::vector<float> logits;
    return seconds_per_call([&] {
      Batch batch;
      const int pos = context_ + step++ % kDecodeSpan;
      for (int i = 0; i < B; ++i)
        batch.seqs.push_back(BatchSeq{&tokens[size_t(i)], 1, pos, T_, tables_[size_t(i)].data(),
                                      int(nb_), true, false});
      r_.forward(batch, &logits);
    }, min_seconds);
  }

 private:
  ModelRunner& r_;
  int T_, context_;
  int64_t nb_;
  std::vector<std::vector<int32_t>> tables_;
};

// Best-of-`reps` seconds (after one untimed call) for one chunk prefilling `n` prompt tokens (the
// engine's chunk size when max_batch_tokens ≥ n), in the blocks after the decode sequences'.
double prefill_seconds(ModelRunner& r, int n, int T, int reps) {
  std::vector<int32_t> table;
  const int64_t first = kMaxBatch * blocks_per_decode_seq();
  for (int64_t b = 0; b < (n + kBlockSize - 1) / kBlockSize; ++b) table.push_back(int32_t(first + b));
  const std::vector<int> ids = some_ids(n, r.config().vocab_size, 99);
  std::vector<float> logits;
  double best = 1e30;
  for (int i = 0; i <= reps; ++i) {  // call 0 warms up (first-touch of buffers), untimed
    const auto t0 = BenchClock::now();
    r.forward(Batch{{BatchSeq{ids.data(), n, 0, T, table.data(), int(table.size()), true, false}}},
              &logits);
    if (i > 0) best = std::min(best, seconds_since(t0));
  }
  return best;
}

// Time to first token of one request through an Engine.
double first_token_seconds(Engine& e, GenerateRequest req) {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<StreamEvent> final_event;
  auto id = e.submit(std::move(req), [&](const StreamEvent& ev) {
    if (ev.finish_reason == FinishReason::kNone) return;
    std::lock_guard<std::mutex> lock(mu);
    final_event = ev;
    cv.notify_all();
  });
  if (!id.ok()) {
    std::fprintf(stderr, "submit: %s\n", id.status().ToString().c_str());
    std::exit(1);
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return final_event.has_value(); });
  const RequestTimings& t = final_event->timings;
  return std::chrono::duration<double>(t.first_token - t.submitted).count();
}

// Best-of-`reps` time to first token of an `n`-token prompt (queueing, prefill, sampling) on a
// warmed-up Engine (a fresh one's first request also pays for first-touch allocations); prefix
// caching is off so every prompt is prefilled in full.
double engine_ttft_seconds(const Model& m, int n, int T, const Settings& s) {
  EngineOptions o;
  o.model_dir = m.dir;
  o.threads = s.threads;
  o.block_size = kBlockSize;
  o.kv_cache_memory = int64_t(m.cfg.max_seq_len) * m.cfg.kv_bytes_per_token();
  o.kv_cache_dtype = s.kv_dtype;
  o.device = s.device;
  o.max_batch_tokens = std::max(512, n);
  o.prefix_caching = false;
  auto e = Engine::create(o);
  if (!e.ok()) {
    std::fprintf(stderr, "engine for %s: %s\n", m.name.c_str(), e.status().ToString().c_str());
    std::exit(1);
  }
  GenerateRequest req;
  req.prompt_ids = some_ids(n, m.cfg.vocab_size, 5);
  req.recursion_depth = T;
  req.sampling.temperature = 0;
  req.sampling.max_new_tokens = 1;
  first_token_seconds(**e, req);
  double best = 1e30;
  for (int i = 0; i < s.prefill_reps; ++i) best = std::min(best, first_token_seconds(**e, req));
  return best;
}

// Decode tokens/s of B requests decoding together through an Engine (scheduling, sampling,
// detokenization-free events included): 16-token prompts, `new_tokens` each, EOS ignored; the
// tokens after each request's first (which prefill gives) over the time from the earliest first
// token to the last finish (the prefill step left out), best of `reps`.
double engine_decode_tokens_per_s(const Model& m, int B, const SamplingParams& sampling, int T,
                                  int reps, const Settings& s) {
  EngineOptions o;
  o.model_dir = m.dir;
  o.threads = s.threads;
  o.block_size = kBlockSize;
  o.kv_cache_memory = kv_budget(m.cfg, s.prompt);
  o.kv_cache_dtype = s.kv_dtype;
  o.device = s.device;
  o.prefix_caching = false;
  auto e = Engine::create(o);
  if (!e.ok()) {
    std::fprintf(stderr, "engine for %s: %s\n", m.name.c_str(), e.status().ToString().c_str());
    std::exit(1);
  }
  double best = 0;
  for (int rep = 0; rep <= reps; ++rep) {  // rep 0 warms the engine up
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    int64_t tokens = 0;
    Clock::time_point first = Clock::time_point::max(), last = Clock::time_point::min();
    for (int i = 0; i < B; ++i) {
      GenerateRequest req;
      req.prompt_ids = some_ids(16, m.cfg.vocab_size, i);
      req.recursion_depth = T;
      req.sampling = sampling;
      req.sampling.seed = uint64_t(i);
      req.sampling.ignore_eos = true;
      auto id = (*e)->submit(std::move(req), [&](const StreamEvent& ev) {
        if (ev.finish_reason == FinishReason::kNone) return;
        std::lock_guard<std::mutex> lock(mu);
        tokens += ev.usage.generated_tokens - 1;
        first = std::min(first, ev.timings.first_token);
        last = std::max(last, ev.timings.finished);
        ++done;
        cv.notify_all();
      });
      if (!id.ok()) {
        std::fprintf(stderr, "submit: %s\n", id.status().ToString().c_str());
        std::exit(1);
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == B; });
    if (rep > 0) best = std::max(best, double(tokens) / seconds_between(first, last));
  }
  return best;
}

struct Cell {
  std::string model;
  int T, B;
};
bool operator<(const Cell& a, const Cell& b) {
  return std::tie(a.model, a.T, a.B) < std::tie(b.model, b.T, b.B);
}

// The 1-minute load average: other work on the machine inflates the times (multi-threaded steps
// most, as every OpenMP barrier waits for a descheduled thread).
std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string first;
  f >> first;
  return first.empty() ? "unknown" : first;
}

// --cell: one decode cell in a loop for 10 s, then its fastest step; --prefill-cell: one prefill
// likewise.
int profile_cell(std::vector<Model>& models, const Settings& s) {
  for (Model& m : models)
    if (m.name == s.cell_model && s.cell_prefill) {
      const double sec = on_own_thread([&] {
        const double once = prefill_seconds(*m.runner, s.prompt, s.cell_T, 1);
        return prefill_seconds(*m.runner, s.prompt, s.cell_T, std::max(1, int(10.0 / once)));
      });
      std::printf("%s T=%d prefill of %d tokens: %.1f ms, %.0f tokens/s\n", m.name.c_str(),
                  s.cell_T, s.prompt, sec * 1e3, s.prompt / sec);
      return 0;
    } else if (m.name == s.cell_model) {
      const double sec = on_own_thread([&] {
        return DecodeBench(*m.runner, s.cell_T, s.cell_context, s.cell_B)
            .step_seconds(s.cell_B, 10.0);
      });
      std::printf("%s T=%d B=%d context %d: %.3f ms/step, %.0f tokens/s\n", m.name.c_str(),
                  s.cell_T, s.cell_B, s.cell_context, sec * 1e3, s.cell_B / sec);
      return 0;
    }
  std::fprintf(stderr, "%s %s: no model named %s (standard, cem, %s)\n",
               s.cell_prefill ? "--prefill-cell" : "--cell", s.cell.c_str(), s.cell_model.c_str(),
               models.back().name.c_str());
  return 2;
}

void print_help() {
  std::printf(
      "usage: bench/engine [--quick] [--threads N] [--kv-cache-dtype fp32|bf16|int8] [--shape "
      "small|base]\n"
      "                    [--device cpu|cpu:DTYPE] [--cell M:T:B [--context N]]\n"
      "                    [--prefill-cell M:T:N]\n"
      "  CPU-runner serving benchmark (decode, batch-1 decode at long context, prefill, TTFT,\n"
      "  KV bytes, targets).\n"
      "  --quick      batches 1/8/32, a 128-token prompt, short timing windows (a smoke run)\n"
      "  --threads N  compute threads (default 0: as serve; 1 is steadier on a busy machine)\n"
      "  --kv-cache-dtype fp32|bf16|int8  the runners' KV cache (default fp32)\n"
      "  --device cpu|cpu:bf16|cpu:bf16dot|cpu:int8|cpu:int8dot  the runners' weights: fp32\n"
      "                  (default), bf16, int8; …dot: those weights, and products that round\n"
      "                  their inputs to them too, with dot-product instructions\n"
      "  --shape small|base  the models' size: small (default) D=256 L=4 V=4096, weights in\n"
      "               cache; base D=1024 L=12 V=32000, 160M/220M parameters, weights in memory\n"
      "  --cell M:T:B decode only model M (standard|cem|cem-L<half the layers>) at depth T,\n"
      "               batch B, for 10 s: a steady loop to run under a profiler (perf record)\n"
      "  --context N  the --cell's cached tokens per sequence (default %d; a multiple of %d,\n"
      "               at most %d)\n"
      "  --prefill-cell M:T:N  likewise, one N-token prefill of model M at depth T (1 <= N <=\n"
      "               1024), best of 10 s\n",
      kContext, kBlockSize, kMaxCellContext);
}

}  // namespace

int main(int argc, char** argv) {
  cemlm::reexec_with_runtime_env(argv);
  Settings s;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) {
      s.batches = {1, 8, 32}, s.prompt = 128, s.min_seconds = 0.05, s.prefill_reps = 1;
      s.rounds = 1;
    } else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) {
      if (!bench::parse_int_in(argv[++i], 0, kMaxThreads, &s.threads)) {
        std::fprintf(stderr, "--threads %s must be an integer from 0 (as serve) to %d\n", argv[i],
                     kMaxThreads);
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--kv-cache-dtype") && i + 1 < argc) {
      s.kv_dtype = argv[++i];
      if (!parse_kv_dtype(s.kv_dtype)) {
        std::fprintf(stderr, "--kv-cache-dtype %s: expected fp32, bf16 or int8\n", argv[i]);
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--device") && i + 1 < argc) {
      s.device = argv[++i];
      if (!is_cpu_device(s.device)) {
        std::fprintf(stderr,
                     "--device %s: expected cpu, cpu:fp32, cpu:bf16, cpu:bf16dot, cpu:int8 or "
                     "cpu:int8dot\n",
                     argv[i]);
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--shape") && i + 1 < argc) {
      s.shape = argv[++i];
      if (s.shape != "small" && s.shape != "base") {
        std::fprintf(stderr, "--shape %s: expected small or base\n", argv[i]);
        return 2;
      }
    } else if ((!std::strcmp(argv[i], "--cell") || !std::strcmp(argv[i], "--prefill-cell")) &&
               i + 1 < argc) {
      const bool prefill = !std::strcmp(argv[i], "--prefill-cell");
      const char* what = prefill ? "N" : "B";
      const int most = prefill ? 1024 : kMaxBatch;
      if (!s.cell.empty()) {  // the second would run with part of the first's settings
        std::fprintf(stderr, "%s: give one --cell or --prefill-cell\n", argv[i]);
        return 2;
      }
      int n = 0, end = 0;
      char name[32] = {};
      s.cell = argv[++i];
      if (std::sscanf(s.cell.c_str(), "%31[^:]:%d:%d%n", name, &s.cell_T, &n, &end) != 3 ||
          size_t(end) != s.cell.size() || s.cell_T < 1 || n < 1 || n > most) {
        std::fprintf(stderr, "%s %s: expected MODEL:T:%s with T >= 1 and 1 <= %s <= %d\n",
                     argv[i - 1], s.cell.c_str(), what, what, most);
        return 2;
      }
      s.cell_model = name;
      (prefill ? s.cell_prefill : s.cell_B) = n;
      if (prefill) s.prompt = n;
    } else if (!std::strcmp(argv[i], "--context") && i + 1 < argc) {
      if (!bench::parse_int_in(argv[++i], kBlockSize, kMaxCellContext, &s.cell_context) ||
          s.cell_context % kBlockSize) {
        std::fprintf(stderr, "--context %s: expected a multiple of %d from %d to %d\n", argv[i],
                     kBlockSize, kBlockSize, kMaxCellContext);
        return 2;
      }
    } else if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      print_help();
      return 0;
    } else {
      const bool takes_value =
          std::string_view(
              "--threads --kv-cache-dtype --device --shape --cell --prefill-cell "
              "--context ")
              .find(std::string(argv[i]) + " ") != std::string_view::npos;
      std::fprintf(stderr, "%s %s; see --help\n",
                   takes_value ? "a value is needed after" : "unknown argument", argv[i]);
      return 2;
    }
  }
  if ((s.cell.empty() || s.cell_prefill) && s.cell_context != kContext) {
    std::fprintf(stderr, "--context applies to a --cell run only\n");
    return 2;
  }
  const auto started = BenchClock::now();
  const std::string root = (std::filesystem::temp_directory_path() /
                            ("cemlm_bench_engine_" + std::to_string(getpid()))).string();
  std::filesystem::create_directories(root);
  // "cem-L<n/2>" has the same shape with half the layers: (cem − it)·2 is the time of all CEM
  // sub-layers in a step, the base of the recursion-cost target.
  std::vector<Model> models;
  const Shape& shape = s.shape == "base" ? kBase : kSmall;
  const std::string half = "cem-L" + std::to_string(shape.layers / 2);
  models.push_back(load_model("standard", bench_config(shape, false, shape.layers), root, s));
  models.push_back(load_model("cem", bench_config(shape, true, shape.layers), root, s));
  models.push_back(load_model(half, bench_config(shape, true, shape.layers / 2), root, s));

  if (!s.cell.empty()) {
    const int rc = profile_cell(models, s);
    std::filesystem::remove_all(root);
    return rc;
  }
  std::printf("%s\n", bench::machine_line().c_str());
  const CpuThreads threads = cpu_threads(s.threads);
  std::printf("models: --shape %s (D=%d, L=%d, H=%d, F=%d, V=%d)\n", s.shape.c_str(), shape.d_model,
              shape.layers, shape.heads, shape.d_ff, shape.vocab);
  std::printf(
      "threads: %d (%s); load average %s; block size %d; KV cache %s; device %s; context %d "
      "tokens per decoding sequence; times are the fastest of repeated steps\n\n",
      threads.threads, threads.why.c_str(), load_average().c_str(), kBlockSize, s.kv_dtype.c_str(),
      s.device.c_str(), kContext);

  // Each cell keeps its best over rounds that sweep every cell, so a busy spell on the machine
  // cannot skew the ratios between cells measured far apart in time.
  const std::map<Cell, double> step = on_own_thread([&] {
    std::map<Cell, double> best;  // seconds per decode step
    for (int round = 0; round < s.rounds; ++round)
      for (Model& m : models)
        for (int T : {1, 2, 4}) {
          const bool recursive = m.name == "cem";  // T changes nothing in standard layers
          if (!recursive && T > 1) continue;
          DecodeBench bench(*m.runner, T);
          for (int B : s.batches) {
            const double sec = bench.step_seconds(B, s.min_seconds);
            auto [it, fresh] = best.try_emplace(Cell{m.name, T, B}, sec);
            if (!fresh) it->second = std::min(it->second, sec);
          }
        }
    return best;
  });
  // Counted at the middle of the decode span's contexts.
  const double n_ctx = kContext + (kDecodeSpan - 1) / 2.0 + 1;
  auto gflops = [&](const Model& m, int T, int B) {
    return decode_flops(m.cfg, T, n_ctx) * B / step.at({m.name, T, B}) / 1e9;
  };
  std::printf("| model | T | batch | ms/step | decode tokens/s | GFLOP/s |\n|---|---|---|---|---|---|\n");
  for (const Model& m : models)
    for (int T : {1, 2, 4})
      for (int B : s.batches)
        if (auto it = step.find(Cell{m.name, T, B}); it != step.end())
          std::printf("| %s | %d | %d | %.2f | %.0f | %.0f |\n", m.name.c_str(), T, B,
                      it->second * 1e3, B / it->second, gflops(m, T, B));
  std::fflush(stdout);
  const ProductRates rates =
      on_own_thread([&] { return product_rates(models[1].cfg, s.device, threads.threads); });
  const double hot = rates.hot / 1e9, cold = rates.cold / 1e9;

  // Batch 1 over longer contexts: a lone sequence's attention passes split over the threads.
  std::printf("\n| model | T | context | batch-1 ms/step | decode tokens/s |\n|---|---|---|---|---|\n");
  for (Model& m : models) {
    if (m.name == half) continue;
    for (int T : {1, 4}) {
      if (m.name == "standard" && T > 1) continue;
      for (int context : {kContext, 512, kLongContext}) {
        const double sec = on_own_thread(
            [&] { return DecodeBench(*m.runner, T, context, 1).step_seconds(1, s.min_seconds); });
        std::printf("| %s | %d | %d | %.2f | %.0f |\n", m.name.c_str(), T, context, sec * 1e3, 1 / sec);
      }
    }
  }
  std::fflush(stdout);

  std::printf("\n| model | T | prefill tokens/s (%d-token prompt) | TTFT ms (warm Engine) |\n|---|---|---|---|\n",
              s.prompt);
  for (Model& m : models) {
    if (m.name == half) continue;
    for (int T : {1, 2, 4}) {
      if (m.name == "standard" && T > 1) continue;
      const double pf =
          on_own_thread([&] { return prefill_seconds(*m.runner, s.prompt, T, s.prefill_reps); });
      const double ttft = engine_ttft_seconds(m, s.prompt, T, s);
      std::printf("| %s | %d | %.0f | %.1f |\n", m.name.c_str(), T, s.prompt / pf, ttft * 1e3);
      std::fflush(stdout);
    }
  }

  // Whole-engine decode: the sampler's cost per row is part of serving (top-p over the vocabulary).
  SamplingParams greedy, nucleus;
  greedy.temperature = 0;
  nucleus.temperature = 0.8f, nucleus.top_p = 0.95f;
  greedy.max_new_tokens = nucleus.max_new_tokens = s.rounds > 1 ? 64 : 16;
  std::printf("\n| model | T | requests | Engine decode tokens/s, greedy | … temperature 0.8, top-p 0.95 "
              "|\n|---|---|---|---|---|\n");
  for (int B : {1, 32}) {
    const Model& m = models[1];
    std::printf("| %s | 1 | %d | %.0f | %.0f |\n", m.name.c_str(), B,
                engine_decode_tokens_per_s(m, B, greedy, 1, s.prefill_reps, s),
                engine_decode_tokens_per_s(m, B, nucleus, 1, s.prefill_reps, s));
    std::fflush(stdout);
  }

  const ModelConfig& cem = models[1].cfg;
  const ModelConfig base = baseline_of(cem);
  const KvDtype dtype = *parse_kv_dtype(s.kv_dtype);
  std::printf("\n| model | KV bytes/token (%s) | vs baseline (fp32) |\n|---|---|---|\n",
              s.kv_dtype.c_str());
  std::printf("| %s | %lld | %.2f× |\n", cem.variant_name().c_str(),
              (long long)cem.kv_bytes_per_token(dtype),
              double(cem.kv_bytes_per_token(dtype)) / double(base.kv_bytes_per_token()));
  std::printf("| %s (baseline) | %lld | %.2f× |\n", base.variant_name().c_str(),
              (long long)base.kv_bytes_per_token(dtype),
              double(base.kv_bytes_per_token(dtype)) / double(base.kv_bytes_per_token()));

  std::printf(
      "\ntarget 1: batch-32 decode tokens/s ÷ batch-1 (target ≥ 8×). Both batches do the same "
      "work\n"
      "per token, so the ratio is their GFLOP/s ratio: 8× needs batch 32 to run at 8 times batch "
      "1's\n"
      "GFLOP/s, shown against the few-row product kernel's rate at 32 rows on the MLP's [%d, %d]\n"
      "weight, same threads and weights, measured now: %.0f GFLOP/s hot (one weight, in the "
      "caches),\n"
      "%.0f cold (copies cycled through 256 MiB, streamed from memory as a base-shape step's "
      "are).\n",
      models[1].cfg.d_ff, models[1].cfg.d_model, hot, cold);
  for (const auto& [name, T] : std::vector<std::pair<std::string, int>>{
           {"standard", 1}, {"cem", 1}, {"cem", 2}, {"cem", 4}}) {
    const Model& m = *std::find_if(models.begin(), models.end(),
                                   [&](const Model& x) { return x.name == name; });
    const double ratio = 32 * step.at({name, T, 1}) / step.at({name, T, 32});
    std::printf(
        "  %-8s T=%d: %.1f× %s; batch 1 at %.0f GFLOP/s, so 8× needs %.0f (%.0f%% of the "
        "hot product rate, %.0f%% of the cold), batch 32 runs at %.0f (%.0f%%, %.0f%%)\n",
        name.c_str(), T, ratio, ratio >= 8 ? "(met)" : "(MISSED)", gflops(m, T, 1),
        8 * gflops(m, T, 1), 800 * gflops(m, T, 1) / hot, 800 * gflops(m, T, 1) / cold,
        gflops(m, T, 32), 100 * gflops(m, T, 32) / hot, 100 * gflops(m, T, 32) / cold);
  }
  std::printf(
      "\ntarget 2: one extra recursion step costs no more than the CEM sub-layers' share of a T=1\n"
      "step. Share measured, not counted: every attention and MLP sub-layer of the full-CEM model\n"
      "is a CEM one, so their time is all %d layers' time: (L=%d model minus L=%d model, same\n"
      "shape) × 2; the rest (embedding, final norm, LM head, host work) is what a T=1 step spends\n"
      "outside.\n",
      shape.layers, shape.layers, shape.layers / 2);
  std::printf("| batch | T=1 ms | CEM sub-layers ms (share) | T=2 − T=1 ms | (T=4 − T=1)/3 ms | extra ÷ sub-layers |\n"
              "|---|---|---|---|---|---|\n");
  for (int B : s.batches) {
    const double t1 = step.at({"cem", 1, B}), t2 = step.at({"cem", 2, B}), t4 = step.at({"cem", 4, B});
    const double sub = 2 * (t1 - step.at({half, 1, B}));
    const double extra = t2 - t1;
    std::printf("| %d | %.2f | %.2f (%.0f%%) | %.2f | %.2f | %.2f %s |\n", B, t1 * 1e3, sub * 1e3,
                100 * sub / t1, extra * 1e3, (t4 - t1) / 3 * 1e3, extra / sub,
                extra <= sub ? "(met)" : "(MISSED)");
  }
  std::filesystem::remove_all(root);
  std::printf("\nwall time: %.0f s\n", seconds_since(started));
  return 0;
}
