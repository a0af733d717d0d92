// The engine's public API: create from a checkpoint, submit/cancel generation requests whose
// events stream back per request, score texts, and read live stats. No gRPC types here: the server
// maps its protos onto these structs. Thread-safe; the step loop runs on the engine's own thread.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cemlm/engine/config.h"
#include "cemlm/engine/sampling.h"

namespace cemlm {

class Tokenizer;
class ModelRunner;
using Clock = std::chrono::steady_clock;
using RequestId = uint64_t;

struct EngineOptions {
  std::string model_dir;
  std::string device = "cpu";           // see make_model_runner: cpu[:fp32|:bf16|:int8], cuda[…]
  int64_t kv_cache_memory = 256 << 20;   // bytes for the paged KV cache
  int block_size = 16;                   // tokens per KV block
  int max_batch_tokens = 512;            // tokens per engine step (chunked prefill budget)
  int max_running = 256;                 // sequences decoding at once
  int max_waiting = 1024;  // bounded queue (beyond free slots the cache can fill; see Scheduler)
  bool prefix_caching = true;
  int threads = 0;                       // CPU threads for compute; 0 = all cores
  std::string kv_cache_dtype = "fp32";   // "fp32" | "bf16" | "int8" (CPU only; KvDtype)
  // Added to the niceness of the step thread (and so of its compute threads, which it starts):
  // a server gives its network threads precedence over a step's compute. 0..19.
  int step_thread_nice = 0;
};

struct GenerateRequest {
  std::vector<int> prompt_ids;           // already tokenized (the server tokenizes text)
  int recursion_depth = 0;               // 0: the model's recursion.default
  SamplingParams sampling;
  int priority = 0;                      // larger runs first; FCFS within a priority
  std::optional<Clock::time_point> deadline;
  std::string client_request_id;         // echoed in logs only
  std::string prompt_field = "prompt_ids";  // the client's field, as validation errors name it
  // Prefix-cache isolation: a request reuses cached blocks only of requests with the same
  // cache_scope (the server's: the caller's API key, or none) and the same cache_salt (the
  // client's, at most kMaxCacheSaltBytes), so that one tenant cannot tell from cached tokens or
  // time to first token what another's prompts held.
  std::string cache_scope;
  std::string cache_salt;
};
inline constexpr size_t kMaxCacheSaltBytes = 256;
// INVALID_ARGUMENT, naming cache_salt, when it is longer than kMaxCacheSaltBytes.
absl::Status check_cache_salt(std::string_view salt);

enum class FinishReason { kNone, kStop, kLength, kCancelled, kDeadline, kError };
const char* finish_reason_name(FinishReason r);  // "stop", "length", ...

struct Usage {
  int prompt_tokens = 0;
  int generated_tokens = 0;
  int64_t recursion_steps = 0;  // CEM recursion steps executed for this request (tokens × T × CEM sub-layers)
  int cached_prompt_tokens = 0; // prompt tokens served from the prefix cache
};

struct RequestTimings {
  Clock::time_point submitted, scheduled, first_token, finished;
};
// Seconds from `from` to `to`; 0 when either is unset or `to` comes first.
double seconds_between(Clock::time_point from, Clock::time_point to);
// Submitted to first scheduled; a request that never left the queue (cancelled, past its deadline
// or drained while waiting) waited until it finished.
double queue_seconds(const RequestTimings& t);

// One event on a request's stream. Token events come in order; exactly one final event
// (finish_reason != kNone) ends every accepted request, whatever happens.
struct StreamEvent {
  RequestId id = 0;
  std::vector<int> token_ids;          // new tokens (usually one)
  std::vector<float> logprobs;         // logprob of each under the unmodified model distribution
  std::vector<std::vector<TopLogprob>> top_logprobs;  // per token, when requested
  std::string text;                    // detokenized text added by these tokens (stop strings cut)
  FinishReason finish_reason = FinishReason::kNone;
  absl::Status error;                  // set when finish_reason == kError
  Usage usage;                         // filled on the final event
  RequestTimings timings;              // filled on the first token's event and the final one
  uint64_t seed = 0;  // final event: the sampling seed, the request's or the one drawn for it
};
using EventCallback = std::function<void(const StreamEvent&)>;

struct ScoreRequest {
  std::vector<int> ids;
  int recursion_depth = 0;
  std::string ids_field = "ids";  // the client's field, as validation errors name it
  // When the cache is full the call waits for room; running requests and calls of lower priority
  // are preempted for it (as for a generation request), equal and higher ones never. Once it
  // runs, it is ranked and preempted as a request of this priority that arrived when it was
  // called (Scheduler::start_scoring): it then waits again and starts over.
  int priority = 0;
  // Checked before each chunk: past the deadline the call ends DEADLINE_EXCEEDED, and once
  // `cancelled` returns true (called on the scoring caller's thread) it ends CANCELLED; either
  // way its cache blocks are freed.
  std::optional<Clock::time_point> deadline;
  std::function<bool()> cancelled;
};
struct ScoreResult {
  std::vector<int> ids;
  std::vector<float> logprobs;  // logprobs[i] = log p(ids[i] | ids[<i]) for i ≥ 1; [0] is NaN (none)
  double nll = 0, perplexity = 0;
  int recursion_depth = 0;
};

// How the message of a RESOURCE_EXHAUSTED status starts when the model ran out of memory on a
// batch (the server's fault, not a refusal for load: the server logs each one).
inline constexpr char kOutOfMemory[] = "out of memory";

struct EngineStats {
  int running = 0;
  int waiting = 0;  // generation requests queued, and scoring calls waiting for cache room
  int scoring = 0;  // scoring calls holding their blocks (chunks running, or waiting their turn)
  double kv_cache_usage = 0;     // 0–1
  int64_t kv_blocks_total = 0, kv_blocks_free = 0;
  int64_t preemptions_total = 0;
  // Prompt tokens served from the prefix cache, counted at each request's first token (those of
  // a request that ends before it count nowhere, as the server's prompt tokens).
  int64_t prefix_cache_hits_total = 0;
};

struct ModelInfo {
  ModelConfig config;
  std::string variant;
  int64_t parameters = 0;
  int64_t kv_bytes_per_token = 0;
  std::string device;                    // canonical_device(EngineOptions::device)
  std::string kv_cache_dtype;            // as EngineOptions
  int64_t kv_cache_capacity_tokens = 0;  // the runner's blocks × block size
};

class Engine {
 public:
  // Loads the checkpoint's runner (make_model_runner, on the engine thread: every forward and
  // OpenMP region of an engine runs there) and its tokenizer.model when it has one.
  static absl::StatusOr<std::unique_ptr<Engine>> create(const EngineOptions& opts);
  // Over an existing runner (tests inject a fake one); `tokenizer` may be null. The block size
  // and the number of blocks come from the runner; opts.model_dir/device/threads are unused.
  static absl::StatusOr<std::unique_ptr<Engine>> create(const EngineOptions& opts,
                                                        std::unique_ptr<ModelRunner> runner,
                                                        std::unique_ptr<Tokenizer> tokenizer);
  // Shuts down (cancelling what still runs) if shutdown() was not called.
  virtual ~Engine() = default;

  // Validates (INVALID_ARGUMENT naming the field), then queues (RESOURCE_EXHAUSTED when the
  // queue is full, UNAVAILABLE after shutdown began). `on_event` is called from the engine thread
  // and must not block; it may call submit() and cancel(), not score() or shutdown(). It is never
  // called after the final event. Text: the events' texts concatenate to the decoded generated
  // ids, cut before the first stop string; stop-token ids add none; cancelled, deadline and
  // error endings drop text still held back (a possible stop-string prefix).
  virtual absl::StatusOr<RequestId> submit(GenerateRequest req, EventCallback on_event) = 0;
  // Idempotent; the request ends with kCancelled and its blocks are freed within one step.
  virtual void cancel(RequestId id) = 0;
  // Blocking prefill-only scoring (the engine thread runs it between steps, in chunks of
  // max_batch_tokens; preempts running requests of lower priority when the cache has no room for
  // the ids, and is preempted as a request is, then starting over: see ScoreRequest::priority).
  virtual absl::StatusOr<ScoreResult> score(const ScoreRequest& req) = 0;
  // Checks a request without submitting it.
  virtual absl::Status validate(const GenerateRequest& req) const = 0;

  virtual const ModelConfig& config() const = 0;
  virtual const Tokenizer* tokenizer() const = 0;  // null when the checkpoint has none
  virtual ModelInfo info() const = 0;
  virtual EngineStats stats() const = 0;

  // Stop accepting; when `cancel_running`, end every request with kCancelled and every score()
  // call under way, between two chunks, with UNAVAILABLE. Waits for the loop.
  virtual void shutdown(bool cancel_running) = 0;
};

}  // namespace cemlm
