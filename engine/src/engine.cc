// Engine implementation: request validation, the step loop on its own thread (schedule → forward →
// sample → stream events), cancellation, deadlines and shutdown, and prefill-only scoring whose
// chunks the loop runs between steps. Every model forward and parallel loop runs on the loop
// thread, the model's loading included: each thread that starts parallel work gets a team of its
// own (cemlm's compute pool, and libgomp's for OpenMP), and once libgomp manages more threads
// than there are cores its barriers stop spinning and sleep instead, which made a batch-1 decode
// step 5–8× slower after the first score call (docs/BENCHMARKS.md, session 7). Lock order: mu_,
// then the scheduler's intake lock.
#include "cemlm/engine/engine.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/kv_blocks.h"
#include "cemlm/engine/model_runner.h"
#include "cemlm/engine/params.h"
#include "cemlm/engine/sampler.h"
#include "cemlm/engine/scheduler.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/tokenizer.h"
#include "cemlm/kernels/parallel.h"
#include "cemlm/kernels/tensor.h"

namespace cemlm {

double seconds_between(Clock::time_point from, Clock::time_point to) {
  if (from == Clock::time_point{} || to == Clock::time_point{} || to < from) return 0;
  return std::chrono::duration<double>(to - from).count();
}

double queue_seconds(const RequestTimings& t) {
  return seconds_between(t.submitted,
                         t.scheduled != Clock::time_point{} ? t.scheduled : t.finished);
}

absl::Status check_cache_salt(std::string_view salt) {
  if (salt.size() <= kMaxCacheSaltBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("cache_salt has ", salt.size(), " bytes; send at most ", kMaxCacheSaltBytes));
}

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kNone: return "none";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kDeadline: return "deadline";
    case FinishReason::kError: return "error";
  }
  return "unknown";
}

namespace {

// Scoring sequences share the block manager with the scheduler's, under ids with this bit set.
constexpr SeqId kScoreSeqBit = SeqId(1) << 63;

// The base of the seeds drawn for requests that set none: 64 bits of the system's entropy (one
// random_device() call gives 32: of ~2^16 server starts, two likely shared a base, and so their
// drawn seeds).
uint64_t random_seed_base() {
  std::random_device device;
  return uint64_t(device()) << 32 | device();
}

// "FIELD (N tokens)", or "FIELD (as tokens: N tokens)" when the field's name ends in a remark of
// its own ("prompt_text (as tokens)"), which a second parenthesis would follow clumsily.
std::string field_with_count(const std::string& field, size_t n) {
  if (!field.empty() && field.back() == ')')
    return absl::StrCat(field.substr(0, field.size() - 1), ": ", n, " tokens)");
  return absl::StrCat(field, " (", n, " tokens)");
}

absl::Status check_options(const EngineOptions& o) {
  auto at_least_one = [](int v, const char* name) {
    return v >= 1 ? absl::OkStatus()
                  : absl::InvalidArgumentError(absl::StrCat(name, " = ", v, " must be >= 1"));
  };
  CEMLM_RETURN_IF_ERROR(at_least_one(o.max_batch_tokens, "max_batch_tokens"));
  CEMLM_RETURN_IF_ERROR(at_least_one(o.max_running, "max_running"));
  if (o.step_thread_nice < 0 || o.step_thread_nice > 19)
    return absl::InvalidArgumentError(
        absl::StrCat("step_thread_nice = ", o.step_thread_nice,
                     " must be in [0, 19] (0: the process's priority)"));
  return at_least_one(o.max_waiting, "max_waiting");
}

// The text side of one request: streaming detokenization of the generated ids as a
// continuation of the prompt, then stop strings.
class TextStream {
 public:
  TextStream(const Tokenizer* tok, std::span<const int> prompt, std::vector<std::string> stops)
      : stops_(std::move(stops)) {
    if (tok) detok_.emplace(*tok, prompt);
  }
  // Text added by the last of the generated `ids`.
  std::string next(std::span<const int> ids, bool* stopped) {
    *stopped = false;
    return detok_ ? stops_.push(detok_->next(ids), stopped) : std::string();
  }
  // The held-back rest when the stream ends after `ids`.
  std::string finish(std::span<const int> ids, bool* stopped) {
    *stopped = false;
    if (!detok_) return {};
    std::string out = stops_.push(detok_->finish(ids), stopped);
    if (!*stopped) out += stops_.flush();
    return out;
  }

 private:
  std::optional<IncrementalDetokenizer> detok_;
  StopMatcher stops_;
};

struct Request {
  RequestId id;
  int n_prompt, recursion, max_new_tokens, top_logprobs;
  uint64_t seed;  // the request's, or drawn for it: reported on the final event
  std::optional<Clock::time_point> deadline;
  EventCallback on_event;
  Sampler sampler;
  TextStream text;
  Usage usage;
  RequestTimings timings;
  bool scheduled = false;
};

using RunnerFactory = std::function<absl::StatusOr<std::unique_ptr<ModelRunner>>()>;

class EngineImpl final : public Engine {
 public:
  // Starts the loop thread, which makes the runner (so that the model loads there too), then
  // steps; returns the engine, or the runner's error once the thread has ended.
  static absl::StatusOr<std::unique_ptr<Engine>> start(const EngineOptions& opts,
                                                       RunnerFactory make_runner,
                                                       std::unique_ptr<Tokenizer> tokenizer);
  ~EngineImpl() override { shutdown(true); }

  absl::StatusOr<RequestId> submit(GenerateRequest req, EventCallback on_event) override;
  void cancel(RequestId id) override;
  absl::StatusOr<ScoreResult> score(const ScoreRequest& req) override;
  absl::Status validate(const GenerateRequest& req) const override;
  const ModelConfig& config() const override { return config_; }
  const Tokenizer* tokenizer() const override { return tokenizer_.get(); }
  ModelInfo info() const override;
  EngineStats stats() const override;
  void shutdown(bool cancel_running) override;

 private:
  absl::Status validate_ids(std::span<const int> ids, const std::string& field) const;
  absl::Status validate_recursion(int depth) const {
    return check_recursion_depth(config_, depth, "recursion_depth");
  }
  int resolve_recursion(int depth) const { return depth ? depth : config_.recursion_default; }
  std::unique_ptr<Request> make_request(RequestId id, const GenerateRequest& req,
                                        EventCallback on_event) const;

  // Takes loop_thread only once nothing else can throw: a constructor that throws (out of memory
  // for the block records) leaves it with the caller, to join.
  EngineImpl(const EngineOptions& opts, std::unique_ptr<ModelRunner> runner,
             std::unique_ptr<Tokenizer> tokenizer, std::thread&& loop_thread);
  void loop();
  // Runs `fn` on the loop thread between steps and returns when it is done.
  void on_loop(std::function<void()> fn);
  // The same for one forward chunk of a scoring call. One such chunk goes per pass of the loop
  // (the highest priority, then the oldest), so per step while generation requests run, as a
  // prompt's chunked prefill shares a step: every waiting call's chunk before each step
  // multiplied the step's time.
  // False, `fn` not run, when the chunk was withdrawn before its turn because `give_up` (looked at
  // every 50 ms, and at `deadline`) said so: a call behind others' chunks must not hold its thread
  // and blocks past its deadline or its client's cancel, nor compute for nobody.
  bool on_loop_chunk(int priority, std::function<void()> fn,
                     std::optional<Clock::time_point> deadline,
                     const std::function<bool()>& give_up);
  void run_jobs();      // the queued on_loop jobs and scoring chunks, on the loop thread
  bool take_control();  // returns whether shutdown began
  bool step();          // false when nothing could be scheduled
  // The runner's forward, with what it throws (chiefly out of memory for a batch's logits) as a
  // status: the step thread must outlive a failed batch, and a scoring call release its blocks.
  absl::Status run_forward(const Batch& batch, std::vector<float>* logits);
  void apply_sample(Request& q, absl::StatusOr<SampleResult> res);
  // Streams the text of the newest of the `generated` ids into `ev`; says whether the request
  // ends with it (a stop token, a stop string, or max_new_tokens).
  FinishReason add_text(Request& q, std::span<const int> generated, StreamEvent* ev);
  void finish(Request& q, FinishReason why, StreamEvent ev, absl::Status error = {});
  void publish_stats();
  // Takes the blocks of a scoring call (`need` of them for `n` tokens at depth T, ranked by its
  // priority and `arrival`), waiting for them when the cache is busy until there is room, the
  // call's deadline passes, it is cancelled or the engine stops; at most max_waiting calls wait at
  // once, but one `preempted` (accepted once already) is never refused.
  absl::Status wait_for_score_room(SeqId seq, int64_t need, int T, int n, uint64_t arrival,
                                   bool preempted, const ScoreRequest& req);
  SeqId first_score_wait() const;  // the scoring call first in line for blocks (0: none)
  // score_turn_, bumped first (waking the calls waiting for their turn) where the first in line
  // is no longer `first_before` (engine thread).
  uint64_t next_score_turn(SeqId first_before);
  void hold_for_first_score();     // holds blocks for it (engine thread, as both)
  // Queues the scoring calls the scheduler preempted for room, before any other admission: one
  // left unqueued until its owner noticed lost its blocks to later requests of its priority.
  void queue_preempted_scores();
  void stop_score_wait(SeqId seq);  // a call leaves the queue (ended, or given room)
  // Runs the call's chunks; stops, OK and *preempted set, at a chunk that finds the call preempted.
  absl::Status score_chunks(SeqId seq, int T, const ScoreRequest& req, ScoreResult* out,
                            bool* preempted);

  const EngineOptions opts_;
  const std::unique_ptr<ModelRunner> runner_;
  const std::unique_ptr<Tokenizer> tokenizer_;
  const ModelConfig config_;
  const int eos_id_;
  const int64_t cem_sublayers_;
  const uint64_t seed_base_;
  std::atomic<RequestId> next_id_{1};

  BlockManager blocks_;  // loop thread only, like the scheduler and the runner
  Scheduler sched_;
  std::unordered_map<RequestId, std::unique_ptr<Request>> live_;  // loop thread only
  std::vector<float> logits_;
  int64_t prefix_hits_total_ = 0;  // loop thread only: cached prompt tokens of first tokens

  mutable std::mutex mu_;  // the hand-over between API callers and the loop
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Request>> incoming_;
  std::vector<RequestId> cancels_;
  std::vector<std::packaged_task<void()>> jobs_;  // on_loop's
  struct Chunk {
    int priority;
    uint64_t order;
    std::packaged_task<void()> task;
  };
  std::vector<Chunk> chunks_;  // on_loop_chunk's
  uint64_t chunks_queued_ = 0;
  int scoring_ = 0;                               // score() calls under way: the loop outlives them
  // Scoring calls waiting for blocks, by sequence (engine thread): their need, priority and
  // arrival (their rank among requests, as Scheduler::take_arrival gave it).
  struct ScoreWait {
    int64_t need;
    int priority;
    uint64_t arrival;
  };
  std::map<SeqId, ScoreWait> score_waits_;
  // Bumped (under mu_) whenever the first waiting scoring call changes: only the first tries for
  // room every millisecond, the others wait for their turn (each try is a job on the engine
  // thread; a thousand calls polling stalled the steps of every request).
  uint64_t score_turn_ = 0;
  std::condition_variable score_turn_cv_;
  bool stopping_ = false, cancel_all_ = false;
  EngineStats stats_;

  std::mutex join_mu_;
  std::thread thread_;  // last: everything above exists before the loop starts
};

EngineImpl::EngineImpl(const EngineOptions& opts, std::unique_ptr<ModelRunner> runner,
                       std::unique_ptr<Tokenizer> tokenizer, std::thread&& loop_thread)
    : opts_(opts),
      runner_(std::move(runner)),
      tokenizer_(std::move(tokenizer)),
      config_(runner_->config()),
      eos_id_(resolve_eos_id(config_.eos_id, tokenizer_.get())),
      cem_sublayers_(int64_t(config_.n_layers) *
                     ((config_.attention == AttentionType::kCem) + (config_.mlp == MlpType::kCem))),
      seed_base_(random_seed_base()),
      blocks_(runner_->num_blocks(), runner_->block_size(), opts.prefix_caching),
      sched_({opts.max_batch_tokens, opts.max_running, opts.max_waiting}, &blocks_) {
  publish_stats();
  thread_ = std::move(loop_thread);
}

std::string mib(int64_t bytes) {
  return bytes < (int64_t(10) << 20) ? absl::StrCat((bytes + 1023) >> 10, " KiB")
                                     : absl::StrCat(bytes >> 20, " MiB");
}

// What a load that ran out of memory was holding: the numbers to size the machine or the flags.
std::string out_of_memory_loading(const ModelConfig& c, const RunnerOptions& ro,
                                  int64_t available) {
  const int64_t params = count_params(c).total;
  return absl::StrCat(
      "out of memory loading the model: its ", params, " parameters take ", mib(params * 4),
      " as loaded (4 bytes each, whatever --device keeps after), the KV cache up to ",
      mib(ro.kv_cache_memory), " (--kv-cache-memory)",
      available >= 0 ? absl::StrCat(", and ", mib(available), " was available when it began") : "",
      " (under the machine's and any cgroup's limit); lower --kv-cache-memory or use a larger "
      "machine");
}

// Linux keeps a niceness per thread, and threads this one starts (OpenMP's) inherit it. Raising
// it needs no privilege; should it fail anyway, the engine runs at the process's priority.
void add_niceness(int nice) {
  if (nice <= 0) return;
  const id_t tid = id_t(syscall(SYS_gettid));
  errno = 0;
  const int now = getpriority(PRIO_PROCESS, tid);
  if (errno == 0) (void)setpriority(PRIO_PROCESS, tid, std::min(19, now + nice));
}

absl::StatusOr<std::unique_ptr<Engine>> EngineImpl::start(const EngineOptions& opts,
                                                          RunnerFactory make_runner,
                                                          std::unique_ptr<Tokenizer> tokenizer) {
  std::promise<absl::StatusOr<std::unique_ptr<ModelRunner>>> made;
  std::future<absl::StatusOr<std::unique_ptr<ModelRunner>>> runner = made.get_future();
  std::promise<EngineImpl*> adopted;  // null: the runner failed, the thread just ends
  std::thread thread([made = std::move(made), engine = adopted.get_future(),
                      make = std::move(make_runner), nice = opts.step_thread_nice]() mutable {
    add_niceness(nice);  // before the runner starts OpenMP's threads, which inherit it
    try {
      made.set_value(make());
    } catch (const std::bad_alloc&) {
      made.set_value(absl::ResourceExhaustedError(
          "out of memory loading the model; lower --kv-cache-memory or use a larger machine"));
    } catch (const std::exception& e) {
      made.set_value(absl::InternalError(absl::StrCat("loading the model: ", e.what())));
    }
    if (EngineImpl* e = engine.get()) e->loop();
  });
  absl::StatusOr<std::unique_ptr<ModelRunner>> r = runner.get();
  if (r.ok() && tokenizer) {
    std::string error;
    if (!check_tokenizer_fits(*tokenizer, (*r)->config().vocab_size, &error))
      r = absl::FailedPreconditionError(absl::StrCat(kTokenizerFile, ": ", error));
  }
  if (!r.ok()) {
    adopted.set_value(nullptr);
    thread.join();
    return r.status();
  }
  EngineImpl* e = nullptr;
  absl::Status failed;
  const int64_t blocks = (*r)->num_blocks();
  try {
    e = new EngineImpl(opts, std::move(*r), std::move(tokenizer), std::move(thread));
  } catch (const std::bad_alloc&) {
    failed = absl::ResourceExhaustedError(absl::StrCat(
        "out of memory for the bookkeeping of the KV cache's ", blocks,
        " blocks (~120-250 bytes each, outside --kv-cache-memory); lower --kv-cache-memory"));
  } catch (const std::exception& ex) {  // std::random_device's, say
    failed = absl::InternalError(absl::StrCat("starting the engine: ", ex.what()));
  }
  if (!e) {  // the loop thread is still ours
    adopted.set_value(nullptr);
    thread.join();
    return failed;
  }
  adopted.set_value(e);
  return std::unique_ptr<Engine>(e);
}

// ---- requests ----

absl::Status EngineImpl::validate_ids(std::span<const int> ids, const std::string& field) const {
  if (ids.empty())
    return absl::InvalidArgumentError(absl::StrCat(field, " is empty; give at least one token"));
  if (int64_t(ids.size()) > config_.max_seq_len)
    return absl::InvalidArgumentError(absl::StrCat(
        field, " has ", ids.size(), " tokens; the model's max_seq_len is ", config_.max_seq_len));
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= config_.vocab_size)
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "] = ", ids[i], " is not a token id in [0, ", config_.vocab_size, ")"));
  return absl::OkStatus();
}

absl::Status EngineImpl::validate(const GenerateRequest& req) const {
  const std::string& field = req.prompt_field;
  CEMLM_RETURN_IF_ERROR(validate_ids(req.prompt_ids, field));
  CEMLM_RETURN_IF_ERROR(validate_recursion(req.recursion_depth));
  CEMLM_RETURN_IF_ERROR(validate_sampling(req.sampling, config_.vocab_size, eos_id_));
  CEMLM_RETURN_IF_ERROR(check_cache_salt(req.cache_salt));
  if (req.cache_scope.find('\0') != std::string::npos)
    return absl::InvalidArgumentError("cache_scope holds a NUL byte; scopes are NUL-free names");
  if (!req.sampling.stop.empty() && !tokenizer_)
    return absl::InvalidArgumentError(
        "sampling.stop needs a tokenizer and this model has none (no tokenizer.model); use "
        "sampling.stop_token_ids");
  const int64_t total = int64_t(req.prompt_ids.size()) + req.sampling.max_new_tokens;
  if (total > config_.max_seq_len)
    return absl::InvalidArgumentError(absl::StrCat(
        field_with_count(field, req.prompt_ids.size()), " + sampling.max_new_tokens (",
        req.sampling.max_new_tokens, ") = ", total, " exceeds the model's max_seq_len = ",
        config_.max_seq_len, "; shorten the prompt or lower sampling.max_new_tokens (",
        SamplingParams{}.max_new_tokens, " when not set)"));
  // The last token generated is never fed back: the cache holds at most total - 1 positions.
  if (const int64_t need = blocks_.blocks_for(total - 1); need > blocks_.num_blocks())
    return absl::InvalidArgumentError(
        absl::StrCat(field, " + sampling.max_new_tokens = ", total, " tokens need ", need,
                     " KV blocks but the cache holds ", blocks_.num_blocks(),
                     "; lower sampling.max_new_tokens, or run with a larger --kv-cache-memory"));
  return absl::OkStatus();
}

std::unique_ptr<Request> EngineImpl::make_request(RequestId id, const GenerateRequest& req,
                                                  EventCallback on_event) const {
  const SamplingParams& p = req.sampling;
  // A drawn seed is below 2^53, so that JSON readers holding numbers as doubles (jq, JavaScript)
  // keep it exact and the sample can be made again from it.
  const uint64_t seed = p.seed ? *p.seed : Rng(seed_base_ + id).next_u64() >> 11;
  return std::unique_ptr<Request>(new Request{
      id, int(req.prompt_ids.size()), resolve_recursion(req.recursion_depth), p.max_new_tokens,
      p.top_logprobs, seed, req.deadline, std::move(on_event), Sampler(p, eos_id_, seed),
      TextStream(tokenizer_.get(), req.prompt_ids, p.stop), Usage{}, RequestTimings{}});
}

absl::StatusOr<RequestId> EngineImpl::submit(GenerateRequest req, EventCallback on_event) {
  CEMLM_RETURN_IF_ERROR(validate(req));
  if (!on_event) return absl::InvalidArgumentError("on_event is empty; pass a callback");
  const RequestId id = next_id_++;
  auto q = make_request(id, req, std::move(on_event));
  q->timings.submitted = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_)
    return absl::UnavailableError("the engine is shutting down; send the request elsewhere");
  // The scope, then the salt: the first NUL ends the scope, so no salt makes another scope's key.
  std::string salt = req.cache_scope.empty() && req.cache_salt.empty()
                         ? std::string()
                         : absl::StrCat(req.cache_scope, std::string(1, '\0'), req.cache_salt);
  CEMLM_RETURN_IF_ERROR(
      sched_.add({id, std::move(req.prompt_ids), q->recursion, req.priority, std::move(salt)}));
  incoming_.push_back(std::move(q));
  cv_.notify_one();
  return id;
}

void EngineImpl::cancel(RequestId id) {
  // An id not issued yet is unknown, and ignored: queued, it ended the request that got it next.
  if (id == 0 || id >= next_id_.load()) return;
  std::lock_guard<std::mutex> lock(mu_);
  cancels_.push_back(id);
  cv_.notify_one();
}

// ---- the step loop ----

void EngineImpl::loop() {
  bool progressed = true;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto news = [this] {
        return (stopping_ && scoring_ == 0) || !incoming_.empty() || !cancels_.empty() ||
               !jobs_.empty() || !chunks_.empty();
      };
      if (live_.empty()) {
        cv_.wait(lock, news);
      } else if (!progressed) {
        // Nothing fit (scoring holds the cache): let it finish instead of spinning.
        cv_.wait_for(lock, std::chrono::milliseconds(1), news);
      }
    }
    run_jobs();
    const bool stopping = take_control();
    progressed = live_.empty() || step();
    publish_stats();
    if (stopping && live_.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (scoring_ == 0) return;
    }
  }
}

void EngineImpl::on_loop(std::function<void()> fn) {
  std::packaged_task<void()> task(std::move(fn));
  std::future<void> done = task.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(task));
    cv_.notify_one();
  }
  done.get();
}

bool EngineImpl::on_loop_chunk(int priority, std::function<void()> fn,
                               std::optional<Clock::time_point> deadline,
                               const std::function<bool()>& give_up) {
  std::packaged_task<void()> task(std::move(fn));
  std::future<void> done = task.get_future();
  uint64_t order;
  {
    std::lock_guard<std::mutex> lock(mu_);
    order = chunks_queued_++;
    chunks_.push_back({priority, order, std::move(task)});
    cv_.notify_one();
  }
  for (;;) {
    auto until = Clock::now() + std::chrono::milliseconds(50);
    if (deadline) until = std::min(until, *deadline);
    if (done.wait_until(until) == std::future_status::ready) break;
    if (!give_up()) continue;
    std::lock_guard<std::mutex> lock(mu_);
    // Still queued: withdrawn. Taken by the loop already: it runs to its end.
    auto it = std::find_if(chunks_.begin(), chunks_.end(),
                           [&](const Chunk& c) { return c.order == order; });
    if (it == chunks_.end()) break;
    chunks_.erase(it);
    return false;
  }
  done.get();
  return true;
}

void EngineImpl::run_jobs() {
  std::vector<std::packaged_task<void()>> jobs;
  std::optional<Chunk> chunk;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs.swap(jobs_);
    // One chunk a pass, with or without generation running (the loop comes straight back while
    // chunks wait): those left queued can still be withdrawn (on_loop_chunk), and the jobs of
    // calls that ended (their blocks) run between chunks.
    if (!chunks_.empty()) {
      auto first = std::min_element(chunks_.begin(), chunks_.end(), [](auto& a, auto& b) {
        return a.priority > b.priority || (a.priority == b.priority && a.order < b.order);
      });
      chunk = std::move(*first);
      chunks_.erase(first);
    }
  }
  for (auto& job : jobs) job();
  if (chunk) chunk->task();
}

bool EngineImpl::take_control() {
  std::vector<RequestId> cancels;
  bool cancel_all, stopping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& q : incoming_) live_[q->id] = std::move(q);
    incoming_.clear();
    sched_.accept();  // under mu_: the scheduler never holds a sequence live_ lacks
    cancels.swap(cancels_);
    cancel_all = cancel_all_;
    stopping = stopping_;
  }
  if (cancel_all)
    for (const auto& [id, q] : live_) cancels.push_back(id);
  for (RequestId id : cancels)
    if (auto it = live_.find(id); it != live_.end())
      finish(*it->second, FinishReason::kCancelled, {});
  const auto now = Clock::now();
  std::vector<RequestId> expired;
  for (const auto& [id, q] : live_)
    if (q->deadline && *q->deadline <= now) expired.push_back(id);
  for (RequestId id : expired) finish(*live_.at(id), FinishReason::kDeadline, {});
  // After those: a request taken over the bound and cancelled (or expired) since displaces
  // nobody, and one cancelled while it was displaced ends as cancelled.
  for (RequestId id : sched_.displace())
    finish(*live_.at(id), FinishReason::kError, {},
           absl::ResourceExhaustedError(absl::StrCat(
               "displaced from the full waiting queue (--max-waiting = ", opts_.max_waiting,
               ") by a request of higher priority; retry later")));
  return stopping;
}

bool EngineImpl::step() {
  const StepPlan plan = sched_.schedule();
  queue_preempted_scores();
  const auto now = Clock::now();
  for (const auto& a : plan.admitted) {
    Request& q = *live_.at(a.id);
    if (q.scheduled) continue;  // readmitted after a preemption: its own blocks, not the cache's
    q.timings.scheduled = now;
    q.scheduled = true;
    q.usage.cached_prompt_tokens = std::min(a.cached_tokens, q.n_prompt);
  }
  if (plan.empty()) return false;
  // As the forward finds them: the requests take_control() just ended gone, those admitted
  // running (the last stats were the previous step's, and stayed so for this whole forward).
  publish_stats();
  if (absl::Status failed = run_forward(plan.batch, &logits_); !failed.ok()) {
    // The batch's requests end with the error; their blocks are freed and none is published.
    for (const ScheduledRow& r : plan.rows)
      if (auto it = live_.find(r.id); it != live_.end())
        finish(*it->second, FinishReason::kError, {}, failed);
    return true;
  }
  sched_.complete(plan);
  const size_t V = size_t(config_.vocab_size);
  std::vector<Request*> sampled;
  for (const ScheduledRow& r : plan.rows) {
    Request& q = *live_.at(r.id);
    q.usage.recursion_steps += int64_t(r.n_tokens) * q.recursion * cem_sublayers_;
    if (r.sample) sampled.push_back(&q);
  }
  CEMLM_CHECK(logits_.size() >= sampled.size() * V);
  // Each request owns its sampler and RNG, so rows are drawn in parallel (a top-p draw over a
  // real vocabulary costs as much as a small model's forward per row); tokens are then applied
  // and streamed in row order.
  std::vector<absl::StatusOr<SampleResult>> drawn(sampled.size());
  std::vector<const Sequence*> seqs(sampled.size());
  for (size_t i = 0; i < sampled.size(); ++i) seqs[i] = sched_.find(sampled[i]->id);
  parallel_for_dynamic(int64_t(sampled.size()), sampled.size() >= 4, [&](int64_t i) {
    drawn[i] = sampled[i]->sampler.sample(std::span<const float>(logits_).subspan(i * V, V),
                                          seqs[i]->tokens, seqs[i]->n_prompt);
  });
  for (size_t i = 0; i < sampled.size(); ++i) apply_sample(*sampled[i], std::move(drawn[i]));
  return true;
}

absl::Status EngineImpl::run_forward(const Batch& batch, std::vector<float>* logits) {
  try {
    runner_->forward(batch, logits);
    return absl::OkStatus();
  } catch (const std::bad_alloc&) {
    int64_t tokens = 0;
    for (const BatchSeq& s : batch.seqs) tokens += s.n_tokens;
    return absl::ResourceExhaustedError(absl::StrCat(
        kOutOfMemory, " running the model on a batch of ", tokens,
        " tokens; retry later, or run with a lower --max-batch-tokens or --kv-cache-memory"));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("the model's forward failed: ", e.what()));
  }
}

void EngineImpl::apply_sample(Request& q, absl::StatusOr<SampleResult> res) {
  const Sequence& seq = *sched_.find(q.id);
  if (!res.ok()) return finish(q, FinishReason::kError, {}, res.status());
  sched_.append(q.id, res->token);
  StreamEvent ev;
  ev.id = q.id;
  ev.token_ids = {res->token};
  ev.logprobs = {res->logprob};
  if (q.top_logprobs) ev.top_logprobs = {std::move(res->top)};
  if (++q.usage.generated_tokens == 1) {
    q.timings.first_token = Clock::now();
    ev.timings = q.timings;  // its queue time is known now: a server need not wait for the end
    // At the first token, as the server counts prompt tokens: the hits are their cached share,
    // and a request that ends in its prefill counts in neither.
    prefix_hits_total_ += q.usage.cached_prompt_tokens;
  }
  const FinishReason why =
      add_text(q, std::span<const int>(seq.tokens).subspan(size_t(seq.n_prompt)), &ev);
  if (why != FinishReason::kNone) return finish(q, why, std::move(ev));
  q.on_event(ev);
}

FinishReason EngineImpl::add_text(Request& q, std::span<const int> generated, StreamEvent* ev) {
  bool stopped = false;
  if (q.sampler.is_stop_token(generated.back())) {
    // The stop token's own text is left out.
    ev->text = q.text.finish(generated.first(generated.size() - 1), &stopped);
    return FinishReason::kStop;
  }
  ev->text = q.text.next(generated, &stopped);
  if (stopped) return FinishReason::kStop;
  if (q.usage.generated_tokens < q.max_new_tokens) return FinishReason::kNone;
  ev->text += q.text.finish(generated, &stopped);
  return stopped ? FinishReason::kStop : FinishReason::kLength;
}

void EngineImpl::finish(Request& q, FinishReason why, StreamEvent ev, absl::Status error) {
  sched_.remove(q.id);
  ev.id = q.id;
  ev.finish_reason = why;
  ev.error = std::move(error);
  q.usage.prompt_tokens = q.n_prompt;
  ev.usage = q.usage;
  ev.seed = q.seed;
  q.timings.finished = Clock::now();
  ev.timings = q.timings;
  const EventCallback on_event = std::move(q.on_event);
  live_.erase(q.id);  // q is gone from here on
  // Its blocks and its running slot are free before its client hears of its end: a scrape right
  // after a stream's last message showed it still running (the stats were the step's start's).
  publish_stats();
  on_event(ev);
}

void EngineImpl::publish_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.running = sched_.num_running();
  stats_.waiting = sched_.num_waiting() + int(score_waits_.size());
  stats_.scoring = sched_.num_scoring();
  stats_.kv_cache_usage = blocks_.usage();
  stats_.kv_blocks_total = blocks_.num_blocks();
  stats_.kv_blocks_free = blocks_.num_available();
  stats_.preemptions_total = sched_.preemptions_total();
  stats_.prefix_cache_hits_total = prefix_hits_total_;
}

EngineStats EngineImpl::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

ModelInfo EngineImpl::info() const {
  return {config_,
          config_.variant_name(),
          count_params(config_).total,
          runner_->kv_bytes_per_token(),
          canonical_device(opts_.device),
          opts_.kv_cache_dtype,
          runner_->num_blocks() * runner_->block_size()};
}

void EngineImpl::shutdown(bool cancel_running) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cancel_all_ = cancel_all_ || cancel_running;
    cv_.notify_one();
    score_turn_cv_.notify_all();
  }
  std::lock_guard<std::mutex> lock(join_mu_);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

// ---- scoring ----

absl::StatusOr<ScoreResult> EngineImpl::score(const ScoreRequest& req) {
  CEMLM_RETURN_IF_ERROR(validate_ids(req.ids, req.ids_field));
  if (req.ids.size() < 2)
    return absl::InvalidArgumentError(absl::StrCat(
        req.ids_field, " has 1 token; scoring needs at least 2 (the first has no logprob)"));
  CEMLM_RETURN_IF_ERROR(validate_recursion(req.recursion_depth));
  const int n = int(req.ids.size()), T = resolve_recursion(req.recursion_depth);
  const int64_t need = blocks_.blocks_for(n);
  if (need > blocks_.num_blocks())
    return absl::InvalidArgumentError(absl::StrCat(
        req.ids_field, " (", n, " tokens) need ", need, " KV blocks but the cache holds ",
        blocks_.num_blocks(), "; shorten it, or run with a larger --kv-cache-memory"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("the engine is shutting down");
    ++scoring_;  // the loop now runs until this call is done
  }
  struct Done {
    EngineImpl* e;
    ~Done() {
      std::lock_guard<std::mutex> lock(e->mu_);
      --e->scoring_;
      e->cv_.notify_one();
    }
  } done{this};
  const SeqId seq = kScoreSeqBit | next_id_++;
  const uint64_t arrival = sched_.take_arrival();  // its rank among requests: from now
  ScoreResult out;
  out.ids = req.ids;
  out.recursion_depth = T;
  out.logprobs.assign(size_t(n), std::numeric_limits<float>::quiet_NaN());
  // A call preempted (its blocks taken by a request ranked above it) waits for room again and
  // starts over.
  for (bool preempted = false, again = true; again; again = preempted) {
    CEMLM_RETURN_IF_ERROR(wait_for_score_room(seq, need, T, n, arrival, preempted, req));
    preempted = false;
    const absl::Status st = score_chunks(seq, T, req, &out, &preempted);
    on_loop([&] {  // published at once: the call returns with its blocks seen free in stats()
      sched_.end_scoring(seq);
      // Preempted, it was queued for room at once (queue_preempted_scores): it keeps that place.
      if (!st.ok() || !preempted) stop_score_wait(seq);
      publish_stats();
    });
    CEMLM_RETURN_IF_ERROR(st);
  }
  double sum = 0;
  for (int i = 1; i < n; ++i) sum += out.logprobs[size_t(i)];
  out.nll = -sum / (n - 1);
  CEMLM_ASSIGN_OR_RETURN(out.perplexity, perplexity_of(out.nll));
  return out;
}

absl::Status EngineImpl::wait_for_score_room(SeqId seq, int64_t need, int T, int n,
                                             uint64_t arrival, bool preempted,
                                             const ScoreRequest& req) {
  enum { kRoom, kWait, kFull } got = kWait;
  bool is_first = false;
  uint64_t turn = 0;  // score_turn_ as this call's last try left it
  bool queued = preempted;  // in score_waits_, for a stop job to take out
  for (bool try_now = true;;) {
    // Before each try: a call past its deadline, cancelled or refused by a shutdown must not
    // take room (preempting running requests of lower priority for nothing).
    absl::Status gave_up;
    if (req.deadline && Clock::now() >= *req.deadline)
      gave_up = absl::DeadlineExceededError(absl::StrCat("deadline exceeded waiting for the ", need,
                                                         " KV blocks to score ", n,
                                                         " tokens (the cache is busy)"));
    else if (req.cancelled && req.cancelled())
      gave_up = absl::CancelledError("cancelled while waiting for KV cache room");
    // A call that ran and was preempted goes on through a shutdown that lets requests finish,
    // as a preempted generation request does.
    else if (std::lock_guard<std::mutex> lock(mu_); preempted ? cancel_all_ : stopping_)
      gave_up = absl::UnavailableError("the engine is shutting down");
    if (!gave_up.ok()) {
      if (queued)
        on_loop([&] {
          stop_score_wait(seq);
          publish_stats();
        });
      return gave_up;
    }
    if (try_now) {
      queued = true;
      on_loop([&] {
        // First come, first served among scoring calls: one behind a waiting call of its priority
        // or higher waits too, rather than take the blocks held for that one.
        const SeqId first = first_score_wait();
        const bool behind =
            first != 0 && first != seq && score_waits_[first].priority >= req.priority;
        if (!behind && sched_.start_scoring(seq, n, T, req.priority, arrival)) {
          got = kRoom;
          score_waits_.erase(seq);
        } else if (preempted || score_waits_.count(seq) ||
                   int(score_waits_.size()) < opts_.max_waiting) {
          got = kWait;
          score_waits_[seq] = {need, req.priority, arrival};
        } else {
          got = kFull;
        }
        queue_preempted_scores();  // those of lower priority start_scoring preempted
        hold_for_first_score();
        publish_stats();
        is_first = first_score_wait() == seq;
        turn = next_score_turn(first);
      });
    }
    if (got == kRoom) return absl::OkStatus();
    if (got == kFull)
      return absl::ResourceExhaustedError(
          absl::StrCat("--max-waiting = ", opts_.max_waiting,
                       " scoring calls are already waiting for KV cache room; retry later or raise "
                       "--max-waiting"));
    // Each try runs between two engine steps; the pause only matters when no step runs. A call
    // behind another waits for its turn or a shutdown (both notify), looking at its deadline and
    // cancellation every 50 ms.
    std::unique_lock<std::mutex> lock(mu_);
    if (is_first) {
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else {
      auto until = Clock::now() + std::chrono::milliseconds(50);
      if (req.deadline) until = std::min(until, *req.deadline);
      score_turn_cv_.wait_until(lock, until, [&] {
        return score_turn_ != turn || (preempted ? cancel_all_ : stopping_);
      });
      try_now = score_turn_ != turn;
    }
  }
}

uint64_t EngineImpl::next_score_turn(SeqId first_before) {
  std::lock_guard<std::mutex> lock(mu_);
  if (first_score_wait() != first_before) {
    ++score_turn_;
    score_turn_cv_.notify_all();
  }
  return score_turn_;
}

SeqId EngineImpl::first_score_wait() const {
  // The waiting call of the highest priority, then the oldest.
  SeqId first = 0;
  for (const auto& [id, w] : score_waits_)
    if (const ScoreWait* f = first ? &score_waits_.at(first) : nullptr;
        !f || w.priority > f->priority || (w.priority == f->priority && w.arrival < f->arrival))
      first = id;
  return first;
}

void EngineImpl::queue_preempted_scores() {
  std::vector<Scheduler::ScoringClaim> claims = sched_.take_preempted_scoring();
  if (claims.empty()) return;
  const SeqId first = first_score_wait();
  for (const auto& c : claims) score_waits_[c.id] = {c.blocks, c.priority, c.arrival};
  hold_for_first_score();
  next_score_turn(first);
}

void EngineImpl::stop_score_wait(SeqId seq) {
  const SeqId first = first_score_wait();
  score_waits_.erase(seq);
  hold_for_first_score();
  next_score_turn(first);
}

void EngineImpl::hold_for_first_score() {
  const SeqId first = first_score_wait();
  if (first == 0) return sched_.hold_for_scoring(0, 0);
  const ScoreWait& w = score_waits_.at(first);
  sched_.hold_for_scoring(w.need, w.priority, w.arrival);
}

absl::Status EngineImpl::score_chunks(SeqId seq, int T, const ScoreRequest& req, ScoreResult* out,
                                      bool* preempted) {
  const std::vector<int>& ids = out->ids;
  const int n = int(ids.size());
  const size_t V = size_t(config_.vocab_size);
  auto give_up = [&] {
    if ((req.deadline && Clock::now() >= *req.deadline) || (req.cancelled && req.cancelled()))
      return true;
    std::lock_guard<std::mutex> lock(mu_);
    return cancel_all_;
  };
  for (int pos = 0; pos < n;) {
    if (req.deadline && Clock::now() >= *req.deadline)
      return absl::DeadlineExceededError(
          absl::StrCat("deadline exceeded after scoring ", pos, " of ", n, " tokens"));
    if (req.cancelled && req.cancelled())
      return absl::CancelledError(absl::StrCat("cancelled after scoring ", pos, " of ", n, " tokens"));
    // A shutdown that cancels what runs ends scoring too: the loop, and so shutdown(), would
    // otherwise wait for every chunk of a long text.
    if (std::lock_guard<std::mutex> lock(mu_); cancel_all_)
      return absl::UnavailableError(
          absl::StrCat("the engine shut down after scoring ", pos, " of ", n, " tokens"));
    const int len = std::min(opts_.max_batch_tokens, n - pos);
    absl::Status ran;
    // On the loop thread, into the engine's own logits buffer, reduced to logprobs there: each
    // call holding its chunk's [len, V] until it returned made concurrent calls cost that much
    // each (24 calls of a 32K vocabulary: 1.7 GB).
    // Withdrawn before its turn (past its deadline, or cancelled): said at the top of the loop.
    if (!on_loop_chunk(
            req.priority,
            [&] {
              if (!sched_.scoring(seq)) {
                *preempted = true;
                return;
              }
              const std::vector<int32_t>& table = blocks_.table(seq);
              BatchSeq s;
              s.tokens = ids.data() + pos;
              s.n_tokens = len;
              s.pos_begin = pos;
              s.recursion = T;
              s.block_table = table.data();
              s.n_blocks = int(table.size());
              s.want_all_logits = true;
              ran = run_forward(Batch{{s}}, &logits_);
              if (!ran.ok()) return;
              CEMLM_CHECK(logits_.size() >= size_t(len) * V);
              // The rows over the compute threads (a 512-row chunk of a 128K vocabulary is ~70 ms
              // on one): 1 where the logits are not finite, 2 where the logprob is below the float
              // range.
              const int rows = std::min(len, n - pos - 1);
              std::vector<uint8_t> bad(size_t(std::max(rows, 0)), 0);
              parallel_for(rows, int64_t(rows) * int64_t(V) > 65536, [&](int64_t i) {
                const std::span<const float> row =
                    std::span<const float>(logits_).subspan(size_t(i) * V, V);
                const LogNormalizer norm = log_normalizer(row);
                const float lp = float(norm.logprob(row[size_t(ids[size_t(pos + i + 1)])]));
                bad[size_t(i)] = !norm.finite() ? 1 : !std::isfinite(lp) ? 2 : 0;
                out->logprobs[size_t(pos + i + 1)] = lp;
              });
              // Non-finite logits are a broken model's (INTERNAL); a log-probability past the
              // float range is the text's under a model that all but rules it out (OUT_OF_RANGE,
              // as a perplexity past a double's: not a server error).
              for (int i = 0; i < rows; ++i)
                if (bad[size_t(i)]) {
                  const std::string what = absl::StrCat(
                      "the model produced ",
                      bad[size_t(i)] == 2 ? "a log-probability below the float range"
                                          : "non-finite logits",
                      " at position ", pos + i,
                      bad[size_t(i)] == 2 ? " (a text it all but rules out, or a broken checkpoint)"
                                          : "; check the checkpoint");
                  ran =
                      bad[size_t(i)] == 2 ? absl::OutOfRangeError(what) : absl::InternalError(what);
                  return;
                }
            },
            req.deadline, give_up))
      continue;
    CEMLM_RETURN_IF_ERROR(ran);
    if (*preempted) break;
    pos += len;
  }
  return absl::OkStatus();
}

}  // namespace

// ---- construction ----

absl::StatusOr<std::unique_ptr<Engine>> Engine::create(const EngineOptions& opts,
                                                       std::unique_ptr<ModelRunner> runner,
                                                       std::unique_ptr<Tokenizer> tokenizer) {
  CEMLM_RETURN_IF_ERROR(check_options(opts));
  if (!runner) return absl::InvalidArgumentError("runner is null");
  auto given = std::make_shared<std::unique_ptr<ModelRunner>>(std::move(runner));
  return EngineImpl::start(
      opts, [given] { return absl::StatusOr<std::unique_ptr<ModelRunner>>(std::move(*given)); },
      std::move(tokenizer));
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::create(const EngineOptions& opts) {
  CEMLM_RETURN_IF_ERROR(check_options(opts));
  // The config first: what is wrong with the directory is said before a tokenizer is loaded
  // (time and memory), and one with more pieces than the model has ids is refused unread.
  CEMLM_ASSIGN_OR_RETURN(const ModelConfig config, load_checkpoint_config(opts.model_dir));
  std::unique_ptr<Tokenizer> tokenizer;
  CEMLM_ASSIGN_OR_RETURN(const std::string tok_path, checkpoint_tokenizer_path(opts.model_dir));
  if (!tok_path.empty()) {
    std::string error;
    tokenizer = Tokenizer::load(tok_path, &error, config.vocab_size);
    if (!tokenizer) return absl::InvalidArgumentError(error);
  }
  const RunnerOptions ro{opts.device, opts.kv_cache_memory, opts.block_size, opts.threads,
                         opts.kv_cache_dtype, opts.max_batch_tokens, opts.max_running};
  return EngineImpl::start(
      opts,
      [dir = opts.model_dir, ro, config]() -> absl::StatusOr<std::unique_ptr<ModelRunner>> {
        const int64_t available = available_memory_bytes();
        try {
          return make_model_runner(dir, ro);
        } catch (const std::bad_alloc&) {
          return absl::ResourceExhaustedError(out_of_memory_loading(config, ro, available));
        }
      },
      std::move(tokenizer));
}

}  // namespace cemlm
