// cemlm.v1.Inference on top of the Engine. Generate uses the callback API: one reactor per stream,
// fed by the engine thread without blocking, so thousands of streams need no thread each. The
// unary RPCs use the synchronous API because Score blocks for a whole prefill.
#pragma once
#include <grpcpp/support/server_interceptor.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cemlm/engine/engine.h"
#include "cemlm/server/auth.h"
#include "cemlm/server/fifo_slots.h"
#include "cemlm/server/metrics.h"
#include "cemlm/v1/inference.grpc.pb.h"

namespace cemlm::server {

// At most one log line a second for a refusal that a client can repeat at will (a missing API
// key, a request body that does not parse), so that it cannot fill the disk.
class LogLimiter {
 public:
  // Whether to log this one; *left_out: how many were not logged since the last line.
  bool allow(int64_t* left_out);

 private:
  std::mutex mu_;
  Clock::time_point last_{};
  int64_t left_out_ = 0;
};

// What every handler shares: the engine (null while loading), admission and drain state.
// A Generate stream the engine has finished whose client has not read all of it yet.
class UnreadStream {
 public:
  // Cancels the call (its client has not read for too long); its OnDone follows (inside it only
  // when gRPC has no executor thread left to run it on).
  virtual void cancel_unread() = 0;
  // Deletes it: its OnDone came inside cancel_unread(), and left that to the caller.
  virtual void destroy() = 0;

 protected:
  ~UnreadStream() = default;
};

class ServerState {
 public:
  // Unary text calls that may wait for their turn, per text slot (see acquire_text_slot).
  static constexpr int kTextWaitersPerSlot = 32;

  // `max_unread`: finished Generate streams not yet read (0: no bound), and `unread_grace`, how
  // long one may wait before it is cancelled for room: see ServerOptions.
  // `max_priority`: the highest request priority a call may ask for when its key sets none.
  // `text_slots`: texts the unary calls tokenize or decode at once (see acquire_text_slot);
  // `max_queued_texts`: Generate calls that wait for their turn at most (see TextWorkers).
  // `cache_per_key`: each API key's requests share prefix-cache blocks among themselves only.
  ServerState(ApiKeys keys, std::string model_name, ServerMetrics* metrics, int max_unread,
              Clock::duration unread_grace, int max_priority, int text_slots, int max_queued_texts,
              bool cache_per_key)
      : keys_(std::make_shared<const ApiKeys>(std::move(keys))),
        model_name_(std::move(model_name)),
        metrics_(metrics),
        max_priority_(max_priority),
        max_unread_(max_unread),
        unread_grace_(unread_grace),
        text_slots_(text_slots, kTextWaitersPerSlot * std::max(1, text_slots)),
        max_queued_texts_(max_queued_texts),
        cache_per_key_(cache_per_key) {}

  // OK admits the call (then release() once when it is over); otherwise the status to return:
  // UNAUTHENTICATED, UNAVAILABLE while loading or draining, or for a Generate stream (`stream`)
  // RESOURCE_EXHAUSTED while max_unread finished streams wait for their clients, once those
  // that waited longer than the grace are cancelled.
  grpc::Status admit(const grpc::ServerContextBase& context, bool stream = false);
  // What admit() refuses every call for, whatever its body: UNAUTHENTICATED, or UNAVAILABLE while
  // loading or draining. A call whose body did not parse gets this status first (its key is
  // checked before its body), and only if OK the malformed body's.
  grpc::Status gate(const grpc::ServerContextBase& context) const;
  // Under TLS, each call's key is also checked as its headers arrive (an AuthMetadataProcessor,
  // inference_server.cc), so that gRPC never reads the body of a call without one:
  // UNAUTHENTICATED for a call of cemlm.v1.Inference (by its ":path") without a valid key,
  // counted and logged as the service counts and logs those it refuses; OK for anything else
  // (health, reflection).
  grpc::Status check_at_headers(const ApiKeys::Metadata& metadata);
  // PERMISSION_DENIED when `priority` is above what the call's key may ask for (its
  // max_priority= in the key file, else the server's --max-priority). When OK and `cache_scope`
  // is given, it is set to the engine's GenerateRequest::cache_scope for the call: its key's
  // (empty when keys are off or the server shares the prefix cache between keys).
  grpc::Status check_priority(const grpc::ServerContextBase& context, int priority,
                              std::string* cache_scope = nullptr) const;
  // A Generate stream the engine has finished: it holds its unsent output until it is done, and
  // then releases with itself.
  void hold_unread(UnreadStream* stream);
  // A write of a held stream completed: its client reads, so its wait starts again.
  void unread_progress(UnreadStream* stream);
  // A held stream's last message is with the transport: it no longer counts as unread.
  void delivered(UnreadStream* stream);
  // The end of an admitted call (its OnDone). False when `held` must not be deleted by the
  // caller: its OnDone came inside the cancel_unread() of admit(), which deletes it after.
  bool release(UnreadStream* held = nullptr);

  // Tokenize, Detokenize and Score's text run on gRPC's sync threads, one a call: each is CPU
  // work and a response of up to max_text_bytes pieces. Only text_slots of them run at once; the
  // others wait here for a slot, first come, first served (a flood of 2000 calls of 30 KB ran 560
  // at once on 2 CPUs, the server's memory 290 MB -> 1.2 GB). OK: the call holds a slot
  // (release_text_slot() once); DEADLINE_EXCEEDED or CANCELLED when the call ended while it
  // waited; RESOURCE_EXHAUSTED at once when kTextWaitersPerSlot × text_slots such calls wait
  // already (each holds a gRPC thread: 1,000 waiting calls took a server to 2,752 threads). The
  // Generate text workers (TextWorkers: a few threads of their own, whose queue --max-waiting
  // bounds) are not `counted` in that line.
  absl::Status acquire_text_slot(const grpc::ServerContextBase& context, bool counted = true);
  void release_text_slot() { text_slots_.release(); }
  int text_slots() const { return text_slots_.total(); }
  int max_queued_texts() const { return max_queued_texts_; }

  // A unary call without a body looking again for a cancel (MalformedBodyInterceptor): true when
  // it may (then end_bodyless_look() once), false while 64 already look.
  bool begin_bodyless_look() {
    if (bodyless_looks_.fetch_add(1) < 64) return true;
    bodyless_looks_.fetch_sub(1);
    return false;
  }
  void end_bodyless_look() { bodyless_looks_.fetch_sub(1); }

  void set_engine(Engine* engine) { engine_.store(engine); }
  Engine& engine() const { return *engine_.load(); }
  bool draining() const { return draining_.load(); }
  // gRPC is about to cancel the calls left (the end of a shutdown): their clients see UNAVAILABLE.
  void stop_calls() { stopping_.store(true); }
  bool stopping() const { return stopping_.load(); }
  // Refuses new calls from now on; true once no admitted call is left, false at the timeout.
  bool drain(Clock::duration timeout);

  // Whether to log a call refused for its API key, or one whose request body does not parse.
  LogLimiter& refused_key_log() { return refused_key_log_; }
  LogLimiter& malformed_body_log() { return malformed_body_log_; }
  // Whether to log a unary call refused for the server's state (loading, draining, full), which
  // a client polling through a load or an overload sends by the hundred a second.
  LogLimiter& busy_log() { return busy_log_; }

  const std::string& model_name() const { return model_name_; }
  // The keys of a --api-key-file read again, each old key keeping its prefix-cache scope.
  void reload_keys(ApiKeys fresh) {
    fresh.keep_identities(*keys_.load());
    keys_.store(std::make_shared<const ApiKeys>(std::move(fresh)));
  }
  ServerMetrics& metrics() const { return *metrics_; }

 private:
  // Replaced whole by reload_keys (SIGHUP) while calls read it.
  std::atomic<std::shared_ptr<const ApiKeys>> keys_;
  const std::string model_name_;
  ServerMetrics* const metrics_;
  const int max_priority_;
  // Cancels held streams that have seen no write complete for the grace, with mu_ released around
  // each cancel_unread() (which may run callbacks inline: a new call's handler, even OnDone).
  void cancel_stale_unread(std::unique_lock<std::mutex>& lock);

  const int max_unread_;
  const Clock::duration unread_grace_;
  std::atomic<Engine*> engine_{nullptr};
  std::atomic<bool> draining_{false}, stopping_{false};
  std::mutex mu_;
  std::condition_variable idle_;
  int in_flight_ = 0;  // guarded by mu_, as is:
  struct Held {
    Clock::time_point since;
    bool cancelled = false;         // by cancel_stale_unread; no longer counted
    bool delivered = false;         // its last message written (delivered()); no longer counted
    std::thread::id cancelling{};   // the thread inside its cancel_unread() now, if any
    bool done_inside = false;       // its OnDone came inside that cancel_unread()
  };
  std::unordered_map<UnreadStream*, Held> unread_;
  int unread_counted_ = 0;                // those neither cancelled nor delivered
  std::condition_variable uncancelling_;  // a cancel_unread() returned
  LogLimiter refused_key_log_, malformed_body_log_, busy_log_;
  FifoSlots text_slots_;
  const int max_queued_texts_;
  const bool cache_per_key_;
  std::atomic<int> bodyless_looks_{0};
};

// Calls of cemlm.v1.Inference whose request body does not parse as the method's message: gRPC
// answers those itself, without running a handler (UNIMPLEMENTED for Generate, INTERNAL for the
// others, no message). The interceptors made here answer INVALID_ARGUMENT naming the message type
// instead, count the call in requests_total and log it.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> malformed_body_interceptors(
    ServerState* state);

// A stream with something to write while none of its writes is in flight.
class IdleStream {
 public:
  virtual void write_pending() = 0;

 protected:
  ~IdleStream() = default;
};

// Starts the writes of idle streams on its own thread, so that the engine thread only queues
// events: a gRPC write costs tens of microseconds, times every stream of an engine step. Later
// writes of a stream start from its write completions, on gRPC's threads.
class WriterThread {
 public:
  WriterThread();
  ~WriterThread();  // after every stream has finished
  void post(IdleStream* stream);

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<IdleStream*> queue_;  // guarded by mu_
  bool stop_ = false;               // guarded by mu_
  std::thread thread_;
};

// Runs the start of Generate streams with a prompt_text off gRPC's callback threads, which
// tokenizing it would hold (~100 ms for a text of the largest size taken): a flood of them made
// health checks wait seconds. Jobs run first come, first served, on as many threads as the
// server has text slots; each job takes a slot as the unary calls do. At most `max_queued` wait.
class TextWorkers {
 public:
  TextWorkers(int threads, int max_queued);
  ~TextWorkers();  // after every stream has finished
  // False, the job dropped, when max_queued jobs wait already.
  bool post(std::function<void()> job);
  int max_queued() const { return max_queued_; }

 private:
  void loop();
  std::mutex mu_;
  std::condition_variable wake_;
  const int max_queued_;
  std::deque<std::function<void()>> queue_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::vector<std::thread> threads_;
};

class InferenceService final
    : public v1::Inference::WithCallbackMethod_Generate<v1::Inference::Service> {
 public:
  explicit InferenceService(ServerState* state)
      : state_(state), text_workers_(state->text_slots(), state->max_queued_texts()) {}

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::Status Score(grpc::ServerContext* context, const v1::ScoreRequest* request,
                     v1::ScoreResponse* response) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const v1::TokenizeRequest* request,
                        v1::TokenizeResponse* response) override;
  grpc::Status Detokenize(grpc::ServerContext* context, const v1::DetokenizeRequest* request,
                          v1::DetokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;

 private:
  // Admission, the handler body, counting (by method and code) and release around every unary RPC.
  template <typename Body>
  grpc::Status unary(grpc::ServerContext* context, const char* method,
                     const google::protobuf::Message& request, Body body);

  ServerState* state_;
  WriterThread writer_;
  TextWorkers text_workers_;
};

}  // namespace cemlm::server
