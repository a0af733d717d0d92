// Handlers of cemlm.v1.Inference (see inference_service.h). The Generate reactor is the delicate
// part: the engine thread hands it events (and starts the first and the last write itself), the
// writer thread starts the other writes of an idle stream, gRPC threads report write completions
// and cancellation, and exactly one of them performs each write and the final Finish.
#include "inference_service.h"

#include <grpc/support/time.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/tokenizer.h"
#include "cemlm/server/convert.h"
#include "cemlm/server/status_map.h"

namespace cemlm::server {

grpc::Status ServerState::gate(const grpc::ServerContextBase& context) const {
  if (grpc::Status auth = keys_.load()->check(context); !auth.ok()) return auth;
  if (draining_.load())
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
  if (!engine_.load())
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the model is still loading; retry later");
  return grpc::Status::OK;
}

grpc::Status ServerState::check_priority(const grpc::ServerContextBase& context, int priority,
                                         std::string* cache_scope) const {
  ApiKeys::Grant grant;
  if (grpc::Status auth = keys_.load()->check(context, &grant); !auth.ok()) return auth;
  const std::optional<int>& key_most = grant.max_priority;
  const int most = key_most.value_or(max_priority_);
  if (priority <= most) {
    if (cache_scope)
      *cache_scope = cache_per_key_ && grant.key >= 0 ? absl::StrCat("key", grant.key) : "";
    return grpc::Status::OK;
  }
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      absl::StrCat("priority = ", priority, " is above ", most, ", the most ",
                   key_most ? "this API key may ask for (its max_priority= in the key file)"
                            : "this server allows (--max-priority)",
                   "; send a priority of at most ", most));
}

grpc::Status ServerState::admit(const grpc::ServerContextBase& context, bool stream) {
  if (grpc::Status auth = keys_.load()->check(context); !auth.ok()) return auth;
  std::unique_lock lock(mu_);
  // Under the lock: a drain that begins now waits for this call, or it is refused.
  if (grpc::Status refused = gate(context); !refused.ok()) return refused;
  // The engine bounds the requests it holds, but a stream it has finished stays open, with its
  // unsent output, until the client reads it: clients that never read would hold memory without
  // a bound. (Streams the engine still runs are its to bound, priority displacement included.)
  // Those that waited past the grace make room: one client that stopped reading must not keep
  // every other client's streams out for as long as its connection lasts.
  if (stream && max_unread_ > 0 && unread_counted_ >= max_unread_) {
    cancel_stale_unread(lock);
    // The lock was let go meanwhile: a drain may have begun and found nothing in flight.
    if (draining_.load())
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server is shutting down");
  }
  if (stream && max_unread_ > 0 && unread_counted_ >= max_unread_)
    return grpc::Status(
        grpc::StatusCode::RESOURCE_EXHAUSTED,
        absl::StrCat("the server holds ", unread_counted_,
                     " finished Generate streams whose clients have not read them (new streams "
                     "wait from --max-running + --max-waiting on, until one is read or has "
                     "waited ",
                     std::chrono::duration<double>(unread_grace_).count(), " s); retry later"));
  ++in_flight_;
  return grpc::Status::OK;
}

void ServerState::cancel_stale_unread(std::unique_lock<std::mutex>& lock) {
  const Clock::time_point cutoff = Clock::now() - unread_grace_;
  std::vector<UnreadStream*> stale;
  for (auto& [s, held] : unread_)
    if (!held.cancelled && !held.delivered && held.since <= cutoff) {
      held.cancelled = true;
      held.cancelling = std::this_thread::get_id();
      --unread_counted_;
      stale.push_back(s);
    }
  metrics_->set_unread_streams(unread_counted_);
  for (UnreadStream* s : stale) {
    // Alive: its OnDone waits in release() for `cancelling` to clear, unless it ran on this thread
    // (inside an earlier one's cancel_unread(); gRPC 1.51 runs a reactor's callbacks on its
    // executor's threads, but may run them inline when it has none, as at its shutdown).
    if (!unread_.at(s).done_inside) {
      // Counted first: its client may see CANCELLED (and scrape) before cancel_unread() returns.
      metrics_->count_unread_cancelled();
      lock.unlock();
      s->cancel_unread();
      lock.lock();
    }
    Held& held = unread_.at(s);
    held.cancelling = {};
    if (held.done_inside) {
      unread_.erase(s);
      s->destroy();
    }
    uncancelling_.notify_all();  // its OnDone may wait in release()
  }
}

bool LogLimiter::allow(int64_t* left_out) {
  std::lock_guard lock(mu_);
  const Clock::time_point now = Clock::now();
  if (now - last_ < std::chrono::seconds(1)) {
    ++left_out_;
    return false;
  }
  last_ = now;
  *left_out = std::exchange(left_out_, 0);
  return true;
}

void ServerState::hold_unread(UnreadStream* stream) {
  std::lock_guard lock(mu_);
  unread_[stream] = {Clock::now()};
  metrics_->set_unread_streams(++unread_counted_);
}

void ServerState::delivered(UnreadStream* stream) {
  std::lock_guard lock(mu_);
  auto it = unread_.find(stream);
  if (it == unread_.end() || it->second.cancelled || it->second.delivered) return;
  it->second.delivered = true;
  metrics_->set_unread_streams(--unread_counted_);
}

void ServerState::unread_progress(UnreadStream* stream) {
  std::lock_guard lock(mu_);
  if (auto it = unread_.find(stream); it != unread_.end()) it->second.since = Clock::now();
}

bool ServerState::release(UnreadStream* held) {
  std::unique_lock lock(mu_);
  if (--in_flight_ == 0) idle_.notify_all();
  auto it = unread_.find(held);
  if (it == unread_.end()) return true;
  if (it->second.cancelling == std::this_thread::get_id()) {
    it->second.done_inside = true;  // inside cancel_unread(): the caller deletes it after
    return false;
  }
  // Another thread is inside its cancel_unread(): the call (and this stream) must outlive that.
  uncancelling_.wait(lock, [&] { return unread_.at(held).cancelling == std::thread::id{}; });
  it = unread_.find(held);  // other streams came and went meanwhile
  if (!it->second.cancelled && !it->second.delivered)
    metrics_->set_unread_streams(--unread_counted_);
  unread_.erase(it);
  return true;
}

bool ServerState::drain(Clock::duration timeout) {
  std::unique_lock lock(mu_);
  draining_.store(true);
  // Streams whose clients stopped reading would hold the drain to its timeout: they are cancelled
  // as they go stale, as admit() does at the bound.
  const Clock::time_point end = Clock::now() + timeout;
  while (in_flight_ > 0 && Clock::now() < end) {
    cancel_stale_unread(lock);
    idle_.wait_until(lock, std::min(end, Clock::now() + std::chrono::milliseconds(100)),
                     [&] { return in_flight_ == 0; });
  }
  return in_flight_ == 0;
}

WriterThread::WriterThread() : thread_([this] { loop(); }) {}

WriterThread::~WriterThread() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void WriterThread::post(IdleStream* stream) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(stream);
  }
  wake_.notify_one();
}

void WriterThread::loop() {
  std::vector<IdleStream*> batch;
  for (;;) {
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      batch.swap(queue_);
    }
    for (IdleStream* s : batch) s->write_pending();
    batch.clear();
  }
}

TextWorkers::TextWorkers(int threads, int max_queued) : max_queued_(std::max(max_queued, 1)) {
  for (int i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { loop(); });
}

TextWorkers::~TextWorkers() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

bool TextWorkers::post(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    if (int(queue_.size()) >= max_queued_) return false;
    queue_.push_back(std::move(job));
  }
  wake_.notify_one();
  return true;
}

void TextWorkers::loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
  }
}

// A slot of ServerState::acquire_text_slot, given back at the end of its scope.
class TextSlot {
 public:
  explicit TextSlot(ServerState* state) : state_(state) {}
  TextSlot(const TextSlot&) = delete;
  TextSlot& operator=(const TextSlot&) = delete;
  ~TextSlot() {
    if (held_) state_->release_text_slot();
  }
  absl::Status take(const grpc::ServerContextBase& context, bool counted = true) {
    absl::Status st = state_->acquire_text_slot(context, counted);
    held_ = st.ok();
    return st;
  }

 private:
  ServerState* const state_;
  bool held_ = false;
};

namespace {

using Response = v1::GenerateResponse;

// Whether a call's text is tokenized, which takes a text slot: an empty one is none, and one
// refused for what it is (not UTF-8, longer than any prompt, no tokenizer) or for another field
// (ids beside it, a bad sampling value ...) is answered at once rather than after a wait for a
// slot and the tokenizing.
bool tokenizes(const Engine& engine, const std::string& text) {
  return !text.empty() && check_text(engine, text, "", "").ok();
}
template <typename Request>
bool tokenizes(const Engine& engine, const std::string& text, const Request& request) {
  return tokenizes(engine, text) && check_before_tokenizing(request, engine).ok();
}

// A client's string as one log field: C escapes (quotes, backslashes, control bytes), at most 256
// bytes of it.
std::string log_escaped(std::string_view s) {
  constexpr size_t kMax = 256;
  std::string out = absl::CEscape(absl::string_view(s.data(), std::min(s.size(), kMax)));
  if (s.size() > kMax) out += "...";
  return out;
}

// A cancellation this close to a call's deadline is taken for the deadline's, and this share of
// the time from the call's arrival to its deadline on top (see deadline_reached).
constexpr auto kDeadlineSlack = std::chrono::milliseconds(20);
constexpr int kDeadlineSlackShare = 50;  // 1/50: 2%

// The call's deadline on this process's steady clock; max() for none. Read from gRPC's own
// timespec: its system_clock deadline() wraps past the year 2262, so a legal grpc-timeout of
// centuries (up to 99999999 hours) read as long expired and such calls failed at once.
Clock::time_point steady_deadline(const grpc::ServerContextBase& context) {
  const gpr_timespec raw = context.raw_deadline();
  if (gpr_time_cmp(raw, gpr_inf_future(raw.clock_type)) == 0) return Clock::time_point::max();
  const gpr_timespec left = gpr_time_sub(gpr_convert_clock_type(raw, GPR_CLOCK_MONOTONIC),
                                         gpr_now(GPR_CLOCK_MONOTONIC));
  constexpr int64_t kCentury = int64_t(100) * 365 * 24 * 3600;  // seconds; further is none
  if (left.tv_sec > kCentury) return Clock::time_point::max();
  return Clock::now() + std::chrono::seconds(left.tv_sec) + std::chrono::nanoseconds(left.tv_nsec);
}

// The slack of deadline_reached for a call that arrived at `arrival` with `deadline`.
Clock::duration deadline_slack(Clock::time_point deadline, Clock::time_point arrival) {
  if (deadline == Clock::time_point::max() || deadline <= arrival) return kDeadlineSlack;
  return kDeadlineSlack + (deadline - arrival) / kDeadlineSlackShare;
}

// gRPC ends a call whose deadline passed by cancelling it, and that cancellation can come before
// this clock reaches the deadline: such a call ended by its deadline. The client's timer runs a
// transit time ahead of this deadline (gRPC's own converts between clocks), and a gRPC client
// rounds the grpc-timeout it sends up to two or three significant digits (2 s is sent as 2010m,
// 15 s as 15100m, 120 s as 121S): its own timer cancels the call up to 1% of its timeout before
// this deadline. Nothing tells a client's deadline from its cancel (both send RST_STREAM CANCEL;
// gRPC's own status for it compares with the deadline too), and this deadline starts when gRPC
// read the headers. So a cancel within 20 ms plus 2% of the call's time (from `arrival`, when the
// service got it, to its deadline) counts as the deadline's: with 20 ms alone, every deadline of
// 10 s or more counted as CANCELLED, and was logged as cancelled by its client. One earlier (its
// headers waited that long to be read, as under load) counts as CANCELLED: a wider slack would
// count clients' own cancels that close to their deadlines as DEADLINE_EXCEEDED instead.
bool deadline_reached(const grpc::ServerContextBase& context, Clock::time_point arrival) {
  const Clock::time_point deadline = steady_deadline(context);
  return deadline - deadline_slack(deadline, arrival) <= Clock::now();
}

// What the client of a unary call sees once its handler returns `status`: gRPC sends no status
// for a call that was cancelled meanwhile (by its client, or by gRPC at its deadline), and an
// answer sent after the deadline arrives after the client's own timer ended the call. Such a call
// ended DEADLINE_EXCEEDED for its client whatever the handler returned (a Score that finished its
// last chunk past the deadline returned OK; one that the deadline's cancellation stopped between
// two chunks returned CANCELLED), and one its client cancelled ended CANCELLED whatever the
// handler returned: OK, or an error that came after the cancel (a Score refused for cache room
// once the step it waited for ended was counted RESOURCE_EXHAUSTED). Calls gRPC cancels at the
// end of a shutdown (`stopping`) keep their status: their clients see UNAVAILABLE.
grpc::Status as_client_saw(const grpc::ServerContext& context, Clock::time_point arrival,
                           bool stopping, grpc::Status status) {
  const bool past_deadline = steady_deadline(context) <= Clock::now();
  if (!past_deadline && !context.IsCancelled()) return status;
  if (past_deadline || deadline_reached(context, arrival)) {
    if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) return status;
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        status.ok()
                            ? std::string("deadline exceeded before the answer was sent")
                            : absl::StrCat("deadline exceeded (", status.error_message(), ")"));
  }
  if (stopping)  // gRPC's stop of the calls left at the end of a shutdown
    return status.ok() ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                      "the server shut down before the answer was sent")
                       : status;
  if (status.error_code() == grpc::StatusCode::CANCELLED) return status;
  return grpc::Status(
      grpc::StatusCode::CANCELLED,
      status.ok()
          ? std::string("cancelled by the client before the answer was sent")
          : absl::StrCat("cancelled by the client (the server's answer: ",
                         grpc_code_name(status.error_code()), ": ", status.error_message(), ")"));
}

class GenerateReactor final : public grpc::ServerWriteReactor<Response>,
                              public IdleStream,
                              public UnreadStream {
 public:
  GenerateReactor(ServerState* state, WriterThread* writer, TextWorkers* text_workers,
                  grpc::CallbackServerContext* context, const v1::GenerateRequest& request)
      : state_(state),
        writer_(writer),
        context_(context),
        arrival_(Clock::now()),
        request_id_(request.request_id()),
        peer_(context->peer()) {
    grpc::Status admitted = state_->admit(*context, /*stream=*/true);
    admitted_ = admitted.ok();
    if (!admitted_) {
      finish_early(admitted);
    } else if (absl::Status st = check_unknown_fields(request); !st.ok()) {
      finish_early(to_grpc_status(st));
    } else if (!tokenizes(state_->engine(), request.prompt_text(), request) ||
               !state_->check_priority(*context, request.priority()).ok()) {
      start(request);  // no tokenizing: ids, or a text refused at once
    } else if (!text_workers->post([this, copy = request] { start(copy); })) {
      // (Tokenized on a text worker, with a text slot: nothing Finishes before start().)
      finish_early(grpc::Status(
          grpc::StatusCode::RESOURCE_EXHAUSTED,
          absl::StrCat(text_workers->max_queued(),
                       " Generate calls already wait for their prompt_text to be tokenized "
                       "(--max-waiting); retry later, or send prompt_ids")));
    }
  }

  void OnWriteDone(bool ok) override {
    std::unique_lock lock(mu_);
    writing_ = false;
    if (!ok) broken_ = true;  // the client is gone; OnCancel follows and cancels the request
    if (ok && unread_held_) state_->unread_progress(this);
    if (last_written_) {
      // All of its output is with the transport: the stream holds nothing unread now, and no
      // longer counts against the bound, before its client can have the end (the status goes
      // after this) and send its next request (counted until OnDone, a moment after, a client
      // pool as large as the bound saw a few refusals a thousand requests).
      if (ok && unread_held_) state_->delivered(this);
      // A last write that failed never reached its client (its cancel, its deadline, the end of
      // a shutdown): counted as it saw it, as a stream whose end was never written is (it was
      // counted OK). One the server cancelled unread stays as the engine finished it.
      if (!ok && !unread_cancelled_) final_status_ = ended_before("the stream was read");
      record_metrics();
      const grpc::Status status = final_status_;
      lock.unlock();
      Finish(status);
      return;
    }
    pump(lock);
  }

  void OnCancel() override {
    std::unique_lock lock(mu_);
    client_cancelled_ = true;
    const std::optional<RequestId> id = id_;
    lock.unlock();
    if (id) state_->engine().cancel(*id);
  }

  void write_pending() override {
    std::unique_lock lock(mu_);
    queued_ = false;
    pump(lock);
  }

  void OnDone() override {
    log();
    if (admitted_) {
      std::unique_lock lock(mu_);
      const bool held = unread_held_;
      lock.unlock();
      if (!state_->release(held ? this : nullptr)) return;  // admit() deletes it
    }
    delete this;
  }

  void cancel_unread() override {
    std::unique_lock lock(mu_);
    unread_cancelled_ = true;
    lock.unlock();
    context_->TryCancel();
  }

  void destroy() override { delete this; }

 private:
  void start(const v1::GenerateRequest& request) {
    std::string cache_scope;
    if (grpc::Status st = state_->check_priority(*context_, request.priority(), &cache_scope);
        !st.ok())
      return finish_early(st);
    Engine& engine = state_->engine();
    absl::StatusOr<GenerateRequest> req;
    {
      TextSlot slot(state_);
      if (tokenizes(engine, request.prompt_text(), request))
        if (absl::Status st = slot.take(*context_, /*counted=*/false); !st.ok())
          // Cancelled while it waited: by its client, or by gRPC at the end of a shutdown.
          return finish_early(absl::IsCancelled(st) ? ended_before("its prompt was tokenized")
                                                    : to_grpc_status(st));
      req = to_engine(request, engine);
    }
    if (!req.ok()) return finish_early(to_grpc_status(req.status()));
    req->cache_scope = std::move(cache_scope);
    if (Clock::time_point d = steady_deadline(*context_); d != Clock::time_point::max())
      req->deadline = d;
    logprobs_ = request.logprobs();
    recursion_depth_ =
        req->recursion_depth ? req->recursion_depth : engine.config().recursion_default;
    prompt_tokens_ = int(req->prompt_ids.size());
    absl::StatusOr<RequestId> id =
        engine.submit(std::move(*req), [this](const StreamEvent& e) { on_event(e); });
    if (!id.ok()) return finish_early(to_grpc_status(id.status()));
    const RequestId submitted = *id;
    std::unique_lock lock(mu_);
    id_ = submitted;
    // A cancellation that came while submitting found no id to cancel.
    const bool cancelled = client_cancelled_;
    // What the engine sent meanwhile waited for this (see starting_). Once pump() lets go of
    // the lock, `this` may be gone: nothing of it is used after.
    starting_ = false;
    pump(lock);
    if (cancelled) engine.cancel(submitted);
  }

  // Before anything was submitted: no event will come, so finish right away. An error after its
  // client cancelled (a full queue, a bad field) is not what the client saw.
  void finish_early(const grpc::Status& status) {
    std::unique_lock lock(mu_);
    const bool cancelled = client_cancelled_;
    lock.unlock();
    final_status_ = status.ok() || !cancelled ? status : ended_before("it was submitted");
    record_metrics();
    Finish(status);
  }

  // Engine thread: only queues, never blocks beyond the reactor's own short critical section.
  void on_event(const StreamEvent& event) {
    std::unique_lock lock(mu_);
    submitted_ = true;  // (id_ may not be set yet: the engine can end a request inside submit())
    observe_tokens(event);
    append_event(event, logprobs_, &pending_);
    has_pending_ = has_pending_ || !event.token_ids.empty() || !event.text.empty();
    if (event.finish_reason != FinishReason::kNone) {
      finished_ = true;
      unread_held_ = true;
      state_->hold_unread(this);
      finish_reason_ = event.finish_reason;
      usage_ = event.usage;
      queue_seconds_ = queue_seconds(event.timings);
      final_status_ = final_status(event);
      // The engine checks deadlines between its steps: a request whose last step ended past its
      // deadline (or after its client cancelled) finished normally, but its client has seen
      // DEADLINE_EXCEEDED (CANCELLED) and gets none of the end. Nor does a client that cancelled
      // see an error that came after (displaced from the queue: RESOURCE_EXHAUSTED).
      const grpc::StatusCode code = final_status_.error_code();
      if (client_cancelled_ ? code != grpc::StatusCode::CANCELLED &&
                                  code != grpc::StatusCode::DEADLINE_EXCEEDED &&
                                  code != grpc::StatusCode::UNAVAILABLE
                            : final_status_.ok() && steady_deadline(*context_) <= Clock::now())
        final_status_ = ended_before(final_status_.ok() ? "the last token" : "the request ended");
      if (final_status_.ok()) {
        set_final(event, request_id_, &pending_);
        has_pending_ = true;
      }
    }
    // The first token and the end of the stream are the latency that clients see (TTFT, end to
    // end): an idle stream starts their write from this thread at once. The tokens in between go
    // through the writer thread, which keeps a step's many writes off the engine thread.
    if (!writing_ && !queued_ && !done_ && (finished_ || !first_written_)) {
      first_written_ = true;
      pump(lock);
      return;
    }
    // A write in flight takes the news when it completes; otherwise the writer thread starts
    // one. Until it does, nothing can Finish, so `this` outlives the post.
    const bool post = !writing_ && !queued_ && !done_;
    queued_ = queued_ || post;
    lock.unlock();
    if (post) writer_->post(this);
  }

  void observe_tokens(const StreamEvent& event) {
    if (event.token_ids.empty()) return;
    const Clock::time_point now = Clock::now();
    ServerMetrics& m = state_->metrics();
    if (last_token_ == Clock::time_point{}) {
      m.observe_first_token(seconds_between(arrival_, now), queue_seconds(event.timings),
                            prompt_tokens_);
    } else {
      const double gap = seconds_between(last_token_, now) / double(event.token_ids.size());
      for (size_t i = 0; i < event.token_ids.size(); ++i) m.observe_inter_token(gap);
    }
    m.count_generated(int(event.token_ids.size()));
    last_token_ = now;
  }

  grpc::Status final_status(const StreamEvent& event) const {
    switch (event.finish_reason) {
      case FinishReason::kStop:
      case FinishReason::kLength:
        return grpc::Status::OK;
      case FinishReason::kDeadline:
        return grpc::Status(
            grpc::StatusCode::DEADLINE_EXCEEDED,
            "deadline exceeded after " + std::to_string(event.usage.generated_tokens) + " tokens");
      case FinishReason::kCancelled:
        if (!client_cancelled_ && state_->draining())
          return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "the server shut down before the request finished "
                              "(--shutdown-timeout)");
        return ended_before("the request finished");
      default:
        return event.error.ok() ? grpc::Status(grpc::StatusCode::INTERNAL, "engine error")
                                : to_grpc_status(event.error);
    }
  }

  // The status of a call ended before `what`, as its client saw it: its deadline, gRPC's stop of
  // the calls left at the end of a shutdown (UNAVAILABLE: counted CANCELLED before), or its
  // client's cancel.
  grpc::Status ended_before(const std::string& what) const {
    if (deadline_reached(*context_, arrival_))
      return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline exceeded before " + what);
    if (state_->stopping())  // its last write failed, or it was cancelled: gRPC stops the calls
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server shut down before " + what);
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client before " + what);
  }

  // Starts the next write or the Finish if one is due and none is in flight. Decides under the
  // lock, acts after releasing it: once Finish is called, OnDone may delete this at any time.
  // Not while the writer thread holds it (queued_): that thread's write_pending() pumps, and a
  // Finish started here could delete it first (start(), after events came while it submitted).
  void pump(std::unique_lock<std::mutex>& lock) {
    if (writing_ || done_ || starting_ || queued_) return;
    if (has_pending_ && !broken_) {
      in_flight_.Swap(&pending_);
      pending_.Clear();
      has_pending_ = false;
      writing_ = true;
      if (finished_ && final_status_.ok()) {
        done_ = true;
        last_written_ = true;  // OnWriteDone counts and finishes the call
        lock.unlock();
        StartWrite(&in_flight_);
      } else {
        lock.unlock();
        StartWrite(&in_flight_);
      }
    } else if (finished_) {
      done_ = true;
      // A stream the engine finished whose end was not written: its client's deadline or its own
      // cancellation ended the call (one the server cancelled unread counts as the engine
      // finished it, and in unread_streams_cancelled_total).
      if (final_status_.ok() && !unread_cancelled_)
        final_status_ = ended_before("the stream was read");
      record_metrics();
      const grpc::Status status = final_status_;
      lock.unlock();
      Finish(status);
    }
  }

  // Just before Finish, so that a client that has its answer also sees it in /metrics.
  void record_metrics() {
    ServerMetrics& m = state_->metrics();
    e2e_seconds_ = seconds_between(arrival_, Clock::now());
    m.count_rpc("Generate", final_status_.error_code());
    if (!submitted_) return;
    m.observe_finished(
        {final_status_.ok() ? finish_reason_name(finish_reason_) : nullptr, recursion_depth_,
         e2e_seconds_,
         last_token_ == Clock::time_point{} ? std::optional(queue_seconds_) : std::nullopt});
  }

  // OnDone: the request's log line, off the engine thread. The client's id and the message (which
  // may quote its input) are escaped: a client must not be able to write lines of its own.
  void log() {
    if (final_status_.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      // Nothing of the caller's own (its client id) is written, and at most a line a second.
      if (int64_t left_out = 0; state_->refused_key_log().allow(&left_out))
        spdlog::info("generate rejected peer={} status=UNAUTHENTICATED message=\"{}\" "
                     "refused_since_last_line={}",
                     peer_, log_escaped(final_status_.error_message()), left_out);
      return;
    }
    if (!id_) {
      // Refused for the server's state (loading, draining, a full queue), at most a line a
      // second: a client polling through them sends hundreds a second.
      const grpc::StatusCode code = final_status_.error_code();
      const bool busy =
          code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::RESOURCE_EXHAUSTED;
      int64_t left_out = 0;
      if (busy && !state_->busy_log().allow(&left_out)) return;
      spdlog::info("generate rejected client_id=\"{}\" peer={} status={} message=\"{}\"{}",
                   log_escaped(request_id_), peer_, grpc_code_name(code),
                   log_escaped(final_status_.error_message()),
                   busy ? absl::StrCat(" refused_since_last_line=", left_out) : "");
      return;
    }
    // The engine ends a call whose gRPC deadline passed as cancelled; the log says which it was.
    const bool deadline = final_status_.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    std::unique_lock lock(mu_);
    const bool undelivered = unread_cancelled_;
    lock.unlock();
    // A batch out of memory is the server's fault: a warning, as a unary call's is.
    const bool out_of_memory = final_status_.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
                               absl::StartsWith(final_status_.error_message(), kOutOfMemory);
    spdlog::log(
        out_of_memory ? spdlog::level::warn : spdlog::level::info,
        "generate id={} client_id=\"{}\" peer={} T={} prompt_tokens={} gen_tokens={} finish={} "
        "status={} latency_ms={:.3f}{}",
        *id_, log_escaped(request_id_), peer_, recursion_depth_, usage_.prompt_tokens,
        usage_.generated_tokens,
        deadline && finish_reason_ == FinishReason::kCancelled
            ? finish_reason_name(FinishReason::kDeadline)
            : finish_reason_name(finish_reason_),
        // What its client saw: the server cancelled the call before all of it was read.
        undelivered ? "CANCELLED" : grpc_code_name(final_status_.error_code()), e2e_seconds_ * 1e3,
        undelivered ? " undelivered=unread_timeout" : "");
  }

  ServerState* const state_;
  WriterThread* const writer_;
  grpc::CallbackServerContext* const context_;
  const Clock::time_point arrival_;
  const std::string request_id_;
  const std::string peer_;  // read at the start: once the call is torn down it says "unknown"
  bool admitted_ = false;
  bool logprobs_ = false;
  int recursion_depth_ = 0, prompt_tokens_ = 0;

  std::mutex mu_;  // guards everything below
  Clock::time_point last_token_{};
  std::optional<RequestId> id_;
  bool submitted_ = false;  // the engine accepted the request (an event of it arrived)
  Response pending_, in_flight_;  // being filled / being written
  bool has_pending_ = false, writing_ = false, queued_ = false, finished_ = false, done_ = false,
       last_written_ = false;  // the final message is the write in flight
  bool broken_ = false, client_cancelled_ = false, first_written_ = false;
  // Until start() has set id_ after submitting: no write or Finish starts, since a Finish could
  // delete this (OnDone) under start(), which runs on a text worker for a prompt_text.
  bool starting_ = true;
  bool unread_held_ = false;       // counted by ServerState::hold_unread
  bool unread_cancelled_ = false;  // by ServerState for room: its output was not all delivered
  FinishReason finish_reason_ = FinishReason::kNone;
  Usage usage_;
  double queue_seconds_ = 0, e2e_seconds_ = 0;
  grpc::Status final_status_;
};

}  // namespace

absl::Status ServerState::acquire_text_slot(const grpc::ServerContextBase& context, bool counted) {
  // No polling for a cancel (a thousand waiting calls polling every 50 ms took most of the CPU):
  // a call cancelled while it waits ends when its turn comes.
  const Clock::time_point deadline = steady_deadline(context);
  const FifoSlots::Acquired acquired = text_slots_.acquire(deadline, counted);
  if (acquired == FifoSlots::Acquired::kLineFull)
    return absl::ResourceExhaustedError(
        absl::StrCat(text_slots_.max_waiting(), " calls already wait for one of the ",
                     text_slots_.total(), " texts tokenized at once (",
                     ServerState::kTextWaitersPerSlot, " a --threads thread); retry later"));
  const bool got = acquired == FifoSlots::Acquired::kGranted;
  // Served just as its deadline passed, or after its client gave up: the slot goes on at once.
  const bool expired = Clock::now() >= deadline;
  if (got && !expired && !context.IsCancelled()) return absl::OkStatus();
  if (got) text_slots_.release();
  if (!got || expired)
    return absl::DeadlineExceededError(absl::StrCat("deadline exceeded waiting for one of the ",
                                                    text_slots_.total(),
                                                    " texts tokenized at once to finish"));
  return absl::CancelledError("cancelled while waiting for its turn to tokenize");
}

grpc::Status ServerState::check_at_headers(const ApiKeys::Metadata& metadata) {
  constexpr absl::string_view kService = "/cemlm.v1.Inference/";
  const auto path = metadata.find(":path");
  if (path == metadata.end()) return grpc::Status::OK;
  const absl::string_view p(path->second.data(), path->second.size());
  if (!absl::StartsWith(p, kService)) return grpc::Status::OK;
  grpc::Status status = keys_.load()->check(metadata);
  if (status.ok()) return status;
  // Counted under its method's name when it names one (any other name would be a new series).
  const absl::string_view method = p.substr(kService.size());
  for (const char* known : {"Generate", "Score", "Tokenize", "Detokenize", "GetModelInfo"})
    if (method == known) metrics_->count_rpc(known, status.error_code());
  if (int64_t left_out = 0; refused_key_log_.allow(&left_out))
    spdlog::info(
        "{} refused at its headers (TLS) status=UNAUTHENTICATED message=\"{}\" "
        "refused_since_last_line={}",
        log_escaped(std::string_view(method.data(), method.size())),
        log_escaped(status.error_message()), left_out);
  return status;
}

grpc::ServerWriteReactor<Response>* InferenceService::Generate(grpc::CallbackServerContext* context,
                                                               const v1::GenerateRequest* request) {
  return new GenerateReactor(state_, &writer_, &text_workers_, context, *request);
}

// One log line per call: at info for scoring and for every failure (a refused key, a bad input,
// a full cache), at debug for the cheap lookups that succeeded.
template <typename Body>
grpc::Status InferenceService::unary(grpc::ServerContext* context, const char* method,
                                     const google::protobuf::Message& request, Body body) {
  const Clock::time_point start = Clock::now();
  grpc::Status status = state_->admit(*context);
  if (status.ok()) {
    absl::Status checked = check_unknown_fields(request);
    grpc::Status answer =  // before stopping() is read
        to_grpc_status(checked.ok() ? body(state_->engine()) : std::move(checked));
    status = as_client_saw(*context, start, state_->stopping(), std::move(answer));
    state_->release();
  }
  state_->metrics().count_rpc(method, status.error_code());
  int64_t left_out = 0;
  const grpc::StatusCode code = status.error_code();
  // A model out of memory is the server's fault, said at each call; the other RESOURCE_EXHAUSTED
  // refusals are its state's (a full queue), as UNAVAILABLE ones are (loading, draining).
  const bool out_of_memory = code == grpc::StatusCode::RESOURCE_EXHAUSTED &&
                             absl::StartsWith(status.error_message(), kOutOfMemory);
  if (code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::UNAVAILABLE ||
      (code == grpc::StatusCode::RESOURCE_EXHAUSTED && !out_of_memory)) {
    LogLimiter& limiter =
        code == grpc::StatusCode::UNAUTHENTICATED ? state_->refused_key_log() : state_->busy_log();
    if (limiter.allow(&left_out))
      spdlog::info("{} peer={} status={} message=\"{}\" refused_since_last_line={}", method,
                   context->peer(), grpc_code_name(code), log_escaped(status.error_message()),
                   left_out);
    return status;
  }
  const bool quiet = status.ok() && std::string_view(method) != "Score";
  spdlog::log(quiet           ? spdlog::level::debug
              : out_of_memory ? spdlog::level::warn
                              : spdlog::level::info,
              "{} peer={} status={} latency_ms={:.3f}{}{}{}", method, context->peer(),
              grpc_code_name(status.error_code()), seconds_between(start, Clock::now()) * 1e3,
              status.ok() ? "" : " message=\"", log_escaped(status.error_message()),
              status.ok() ? "" : "\"");
  return status;
}

grpc::Status InferenceService::Score(grpc::ServerContext* context, const v1::ScoreRequest* request,
                                     v1::ScoreResponse* response) {
  const Clock::time_point arrival = Clock::now();
  grpc::Status status = unary(context, "Score", *request, [&](Engine& engine) -> absl::Status {
    if (grpc::Status st = state_->check_priority(*context, request->priority()); !st.ok())
      return absl::PermissionDeniedError(st.error_message());
    absl::StatusOr<ScoreRequest> converted;
    {
      TextSlot slot(state_);
      if (tokenizes(engine, request->text(), *request)) CEMLM_RETURN_IF_ERROR(slot.take(*context));
      converted = to_engine(*request, engine);
    }
    CEMLM_ASSIGN_OR_RETURN(ScoreRequest req, std::move(converted));
    // A long text is scored in chunks; a client that gave up (or ran out of time) stops it
    // between two, freeing the cache blocks it held.
    if (Clock::time_point d = steady_deadline(*context); d != Clock::time_point::max())
      req.deadline = d;
    req.cancelled = [context] { return context->IsCancelled(); };
    CEMLM_ASSIGN_OR_RETURN(ScoreResult result, engine.score(req));
    *response = to_proto(result);
    return absl::OkStatus();
  });
  // Only what the client received: a scored call that it saw end DEADLINE_EXCEEDED or CANCELLED
  // (see as_client_saw) counts in requests_total under that code and nowhere here.
  if (status.ok())
    state_->metrics().observe_scored(seconds_between(arrival, Clock::now()),
                                     response->token_ids_size(), response->recursion_depth());
  return status;
}

grpc::Status InferenceService::Tokenize(grpc::ServerContext* context,
                                        const v1::TokenizeRequest* request,
                                        v1::TokenizeResponse* response) {
  return unary(context, "Tokenize", *request, [&](Engine& engine) -> absl::Status {
    TextSlot slot(state_);
    if (tokenizes(engine, request->text())) CEMLM_RETURN_IF_ERROR(slot.take(*context));
    CEMLM_ASSIGN_OR_RETURN(std::vector<int> ids,
                           encode_text(engine, request->text(), "text", "", request->add_bos()));
    for (int id : ids) {
      response->add_ids(id);
      response->add_pieces(engine.tokenizer()->id_to_piece(id));
    }
    return absl::OkStatus();
  });
}

grpc::Status InferenceService::Detokenize(grpc::ServerContext* context,
                                          const v1::DetokenizeRequest* request,
                                          v1::DetokenizeResponse* response) {
  return unary(context, "Detokenize", *request, [&](Engine& engine) -> absl::Status {
    if (!engine.tokenizer())
      return absl::InvalidArgumentError("ids: this model has no tokenizer to decode them with");
    // Bounded as texts are: any text the server takes has at most this many ids.
    if (const int64_t most = max_text_bytes(engine); request->ids_size() > most)
      return absl::InvalidArgumentError(absl::StrCat("ids has ", request->ids_size(),
                                                     " ids; at most ", most, " (see Tokenize)"));
    CEMLM_RETURN_IF_ERROR(check_ids(request->ids(), engine.config().vocab_size, "ids"));
    // And so is their text, before it is made: ids of the longest piece made a text that many
    // times longer (98 MB from 30 KB of ids with a piece of 16 KB), and no default client
    // receives more than 4 MiB.
    const std::vector<int> ids(request->ids().begin(), request->ids().end());
    constexpr int64_t kMaxResponseText = (int64_t(4) << 20) - 1024;
    if (const int64_t bytes = engine.tokenizer()->decoded_bytes_bound(ids),
        most = std::min(max_text_bytes(engine), kMaxResponseText);
        bytes > most)
      return absl::InvalidArgumentError(absl::StrCat(
          "ids: their text would have ", bytes, " bytes, more than the ", most,
          " a Detokenize may return (the longest text the server takes, at most 4 MiB); send "
          "them in parts"));
    TextSlot slot(state_);
    CEMLM_RETURN_IF_ERROR(slot.take(*context));
    response->set_text(engine.tokenizer()->decode(ids));
    return absl::OkStatus();
  });
}

grpc::Status InferenceService::GetModelInfo(grpc::ServerContext* context,
                                            const v1::GetModelInfoRequest* request,
                                            v1::ModelInfo* response) {
  return unary(context, "GetModelInfo", *request, [&](Engine& engine) -> absl::Status {
    *response = model_info(engine, state_->model_name());
    return absl::OkStatus();
  });
}

namespace {

class MalformedBodyInterceptor final : public grpc::experimental::Interceptor {
 public:
  MalformedBodyInterceptor(ServerState* state, grpc::experimental::ServerRpcInfo* info,
                           std::string method, std::string message)
      : state_(state),
        info_(info),
        method_(std::move(method)),
        message_(std::move(message)),
        arrival_(Clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    using Hook = grpc::experimental::InterceptionHookPoints;
    // A body that did not parse (or no body) reaches the interceptors as no message at all; gRPC
    // then answers INTERNAL or UNIMPLEMENTED. Any other status it sends (RESOURCE_EXHAUSTED when
    // it has no thread for the call, say) is left as it is.
    if (m->QueryInterceptionHookPoint(Hook::POST_RECV_MESSAGE) && !m->GetRecvMessage())
      malformed_ = true;
    const bool grpcs_own = malformed_ && m->QueryInterceptionHookPoint(Hook::PRE_SEND_STATUS) &&
                           (m->GetSendStatus().error_code() == grpc::StatusCode::INTERNAL ||
                            m->GetSendStatus().error_code() == grpc::StatusCode::UNIMPLEMENTED);
    const std::optional<grpc::StatusCode> ended =
        grpcs_own && !streaming() ? ended_before_body() : std::nullopt;
    // Sent in gRPC's place where the client may still be there to see it (a cancelled call's
    // status goes nowhere).
    if (ended == grpc::StatusCode::DEADLINE_EXCEEDED)
      m->ModifySendStatus(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                       "deadline exceeded before the request body arrived"));
    if (grpcs_own && !ended) {
      // Of the requests, only GenerateRequest has a string field (the others' texts are bytes).
      const bool strings = streaming();
      // A wrong key, a load or a drain refuse the call before its body is looked at.
      const grpc::Status refused = state_->gate(*info_->server_context());
      const grpc::Status status =
          !refused.ok()
              ? refused
              : grpc::Status(
                    grpc::StatusCode::INVALID_ARGUMENT,
                    absl::StrCat("the request body is not a valid ", message_, " message (missing",
                                 strings ? ", bytes that do not parse, or request_id not in UTF-8"
                                         : " or bytes that do not parse",
                                 "); build the client from this server's "
                                 "cemlm/v1/inference.proto (server reflection serves it)"));
      m->ModifySendStatus(status);
      std::optional<bool> closed;
      {
        std::lock_guard<std::mutex> lock(mu_);
        sent_ = status;
        closed = closed_cancelled_;
      }
      if (!streaming())
        record(false);
      else if (closed)  // the call ended first (its close ran on another thread)
        record(*closed);
    }
    // Generate's calls (gRPC's callback API) are counted once over, when gRPC knows whether they
    // were cancelled: at the status, a client's cancel may not have reached the call yet (9 of 10
    // cancels within 2 ms of the headers counted as malformed bodies). The unary methods (the sync
    // API) cannot ask then (IsCancelled() runs this very hook again), so they decide at the status.
    if (streaming() && m->QueryInterceptionHookPoint(Hook::POST_RECV_CLOSE)) {
      const bool cancelled = info_->server_context()->IsCancelled();
      bool sent = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        closed_cancelled_ = cancelled;
        sent = sent_.has_value();
      }
      if (sent) record(cancelled);
    }
    m->Proceed();
  }

 private:
  bool streaming() const { return message_ == v1::GenerateRequest::descriptor()->full_name(); }

  // Counts the call, and logs a malformed body, unless it was `cancelled` (by its client or at its
  // deadline): then it counts as that, and is not logged as a client's mistake.
  void record(bool cancelled) {
    grpc::ServerContextBase* const ctx = info_->server_context();
    if (cancelled) {
      state_->metrics().count_rpc(method_.c_str(), deadline_reached(*ctx, arrival_)
                                                       ? grpc::StatusCode::DEADLINE_EXCEEDED
                                                       : grpc::StatusCode::CANCELLED);
      return;
    }
    state_->metrics().count_rpc(method_.c_str(), sent_->error_code());
    if (int64_t left_out = 0; sent_->error_code() == grpc::StatusCode::INVALID_ARGUMENT &&
                              state_->malformed_body_log().allow(&left_out))
      spdlog::info("{} peer={} status=INVALID_ARGUMENT message=\"{}\" malformed_since_last_line={}",
                   method_, ctx->peer(), log_escaped(sent_->error_message()), left_out);
  }

  // A call whose deadline passed, or that its client cancelled, before its body arrived also
  // reaches the interceptors with no message: that is no malformed body. It is counted as what it
  // was (the client sees that status, not ours), and not logged as a client's mistake.
  // The deadline is read as the handlers read it: gRPC's system_clock deadline() wraps for a
  // grpc-timeout of centuries, which made a malformed body sent with one count as
  // DEADLINE_EXCEEDED while its client got gRPC's own INTERNAL or UNIMPLEMENTED.
  // A cancel that came before the body reaches the call a moment after its missing message (2 to
  // 15% of such unary calls counted as malformed): the call looks again for up to 20 ms before it
  // counts as one, never past its deadline (its answer would then come too late), and only while
  // fewer than 64 such calls look at once (each holds a gRPC thread meanwhile). Only calls whose
  // body is missing or does not parse look.
  // Within the slack of its deadline, a missing body is most likely that deadline's cancel on its
  // way: the call waits for its deadline, at most the slack, and ends DEADLINE_EXCEEDED, counted
  // so and answered so if its client is still there, whatever its body was (2 of 300 calls with
  // 1 ms deadlines counted as malformed bodies and were logged as such; an answer of gRPC's own
  // INTERNAL at the deadline reached clients whose timers had not yet fired).
  std::optional<grpc::StatusCode> ended_before_body() {
    grpc::ServerContextBase* const ctx = info_->server_context();
    grpc::StatusCode code = grpc::StatusCode::OK;
    const Clock::time_point deadline = steady_deadline(*ctx);
    if (deadline <= Clock::now())
      code = grpc::StatusCode::DEADLINE_EXCEEDED;
    else if (ctx->IsCancelled())
      code = deadline_reached(*ctx, arrival_) ? grpc::StatusCode::DEADLINE_EXCEEDED
                                              : grpc::StatusCode::CANCELLED;
    constexpr auto kLook = std::chrono::microseconds(250);
    const bool near_deadline = deadline_reached(*ctx, arrival_);
    const Clock::time_point until =
        near_deadline ? deadline
                      : std::min(Clock::now() + std::chrono::milliseconds(20),
                                 deadline - deadline_slack(deadline, arrival_) - kLook);
    if (code == grpc::StatusCode::OK && state_->begin_bodyless_look()) {
      while (code == grpc::StatusCode::OK && Clock::now() < until) {
        std::this_thread::sleep_for(std::min<Clock::duration>(kLook, until - Clock::now()));
        if (ctx->IsCancelled())
          code = deadline_reached(*ctx, arrival_) ? grpc::StatusCode::DEADLINE_EXCEEDED
                                                  : grpc::StatusCode::CANCELLED;
      }
      state_->end_bodyless_look();
      if (code == grpc::StatusCode::OK && near_deadline) code = grpc::StatusCode::DEADLINE_EXCEEDED;
    }
    if (code == grpc::StatusCode::OK) return std::nullopt;
    state_->metrics().count_rpc(method_.c_str(), code);
    return code;
  }

  ServerState* const state_;
  grpc::experimental::ServerRpcInfo* const info_;
  const std::string method_, message_;
  const Clock::time_point arrival_;  // about when the call arrived (its interceptors are made)
  bool malformed_ = false;
  // The status and the close may come on two threads (gRPC runs a call's close where it lands).
  std::mutex mu_;
  std::optional<grpc::Status> sent_;      // the status this interceptor put in gRPC's place
  std::optional<bool> closed_cancelled_;  // at the close: whether the call was cancelled
};

class MalformedBodyInterceptors final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MalformedBodyInterceptors(ServerState* state) : state_(state) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // Only the service's own methods (their names are its proto's, so the metric's method label
    // stays within them); health checks and reflection are left alone.
    const std::string_view path = info->method();
    const std::string prefix = absl::StrCat("/", v1::Inference::service_full_name(), "/");
    if (path.substr(0, prefix.size()) != prefix) return nullptr;
    const std::string method(path.substr(prefix.size()));
    const google::protobuf::MethodDescriptor* d = v1::GenerateRequest::descriptor()
                                                      ->file()
                                                      ->FindServiceByName("Inference")
                                                      ->FindMethodByName(method);
    if (!d) return nullptr;
    return new MalformedBodyInterceptor(state_, info, method, d->input_type()->full_name());
  }

 private:
  ServerState* const state_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> malformed_body_interceptors(
    ServerState* state) {
  return std::make_unique<MalformedBodyInterceptors>(state);
}

}  // namespace cemlm::server
