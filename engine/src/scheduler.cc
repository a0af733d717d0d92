// Scheduler (see scheduler.h for the policy). Only add() and num_waiting() take the intake lock;
// everything else runs on the engine's step thread.
#include "cemlm/engine/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cemlm/kernels/tensor.h"

namespace cemlm {

bool Scheduler::RankLess::operator()(const Sequence* a, const Sequence* b) const {
  if (a->priority != b->priority) return a->priority > b->priority;
  return a->arrival < b->arrival;
}

namespace {

// Tokens that `plan` feeds for `id` (0 when it has no row).
int row_tokens(const StepPlan& plan, SeqId id) {
  for (const ScheduledRow& r : plan.rows)
    if (r.id == id) return r.n_tokens;
  return 0;
}

}  // namespace

Scheduler::Scheduler(const SchedulerOptions& opts, BlockManager* blocks)
    : opts_(opts), blocks_(blocks), free_slots_published_(opts.max_running) {
  CEMLM_CHECK(opts.max_batch_tokens > 0 && opts.max_running > 0 && opts.max_waiting > 0);
}

absl::Status Scheduler::add(SeqSpec spec) {
  std::lock_guard<std::mutex> lock(intake_mu_);
  // In 64 bits: --max-waiting and --max-running may each be up to INT_MAX.
  if (int64_t(intake_.size()) + waiting_published_ >=
      int64_t(opts_.max_waiting) + free_slots_published_) {
    // Each sequence taken over the bound displaces one of lower priority that has not started:
    // there must be one left that those taken before it have not claimed.
    auto below = std::lower_bound(displaceable_published_.begin(), displaceable_published_.end(),
                                  spec.priority) -
                 displaceable_published_.begin();
    for (const auto& s : intake_) below += s->priority < spec.priority;
    if (below <= int64_t(over_bound_.size()))
      return absl::ResourceExhaustedError(
          absl::StrCat("the waiting queue is full (--max-waiting = ", opts_.max_waiting,
                       " requests); retry later"));
    over_bound_.push_back(spec.priority);  // one of lower priority makes way at displace()
  }
  auto s = std::make_unique<Sequence>();
  s->id = spec.id;
  s->n_prompt = int(spec.prompt.size());
  s->tokens = std::move(spec.prompt);
  s->recursion = spec.recursion;
  s->priority = spec.priority;
  s->cache_salt = std::move(spec.cache_salt);
  s->arrival = next_arrival_++;
  intake_.push_back(std::move(s));
  return absl::OkStatus();
}

int Scheduler::num_waiting() const {
  std::lock_guard<std::mutex> lock(intake_mu_);
  return int(intake_.size()) + waiting_published_;
}

bool Scheduler::has_work() const { return !running_.empty() || num_waiting() > 0; }

void Scheduler::accept() {
  std::lock_guard<std::mutex> lock(intake_mu_);
  // What the cache held back has left since (cancelled, ended): the arrivals are another queue,
  // which the next schedule() judges (an idle engine runs none till then).
  if (waiting_.empty()) blocked_on_cache_ = false;
  for (auto& s : intake_) {
    CEMLM_CHECK(!seqs_.count(s->id));
    waiting_.insert(s.get());
    seqs_[s->id] = std::move(s);
  }
  intake_.clear();
  // The claims of these on a queued one: displace() settles them. Those of sequences added from
  // now on wait for the next accept().
  accepted_claims_ = over_bound_.size();
  publish_locked();  // add() counts what was taken from the intake as queued
}

std::vector<SeqId> Scheduler::displace() {
  std::lock_guard<std::mutex> lock(intake_mu_);
  // As many as the queue is still over its bound, at most those taken over it (a slot may have
  // freed since), each of lower priority than one taken over it: the lowest-ranked first, each
  // claimed by the lowest such priority. (The one a sequence was taken to displace may have been
  // admitted since; it must then not displace one of its own priority, or itself.)
  std::vector<int> claims(over_bound_.begin(), over_bound_.begin() + ptrdiff_t(accepted_claims_));
  over_bound_.erase(over_bound_.begin(), over_bound_.begin() + ptrdiff_t(accepted_claims_));
  accepted_claims_ = 0;
  int64_t queued = 0;
  for (const Sequence* s : waiting_) queued += !s->displaced;
  int64_t excess =
      std::min<int64_t>(int64_t(claims.size()), queued - opts_.max_waiting - free_slots());
  std::sort(claims.begin(), claims.end());
  std::vector<SeqId> displaced;
  for (auto it = waiting_.rbegin(); excess > 0 && it != waiting_.rend(); ++it) {
    if ((*it)->admitted_before || (*it)->displaced) continue;  // a preempted one keeps its place
    const auto by = std::upper_bound(claims.begin(), claims.end(), (*it)->priority);
    if (by == claims.end()) continue;
    claims.erase(by);
    (*it)->displaced = true;
    displaced.push_back((*it)->id);
    --excess;
  }
  publish_locked();
  return displaced;
}

void Scheduler::publish_waiting() {
  std::lock_guard<std::mutex> lock(intake_mu_);
  publish_locked();
}

void Scheduler::publish_locked() {
  // The displaced stay queued until their owner removes them, but count for nothing.
  waiting_published_ = 0;
  displaceable_published_.clear();
  for (auto it = waiting_.rbegin(); it != waiting_.rend(); ++it) {  // lowest rank first: ascending
    if ((*it)->displaced) continue;
    ++waiting_published_;
    if (!(*it)->admitted_before) displaceable_published_.push_back((*it)->priority);
  }
  free_slots_published_ = free_slots();
}

int Scheduler::free_slots() const {
  return blocked_on_cache_ ? 0 : std::max(0, opts_.max_running - int(running_.size()));
}

const Sequence* Scheduler::find(SeqId id) const {
  auto it = seqs_.find(id);
  return it == seqs_.end() ? nullptr : it->second.get();
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  int budget = opts_.max_batch_tokens;
  std::set<SeqId> scheduled;
  // Priority levels of the running sequences, highest first (running_ is in rank order).
  std::vector<int> levels;
  for (const Sequence* s : running_)
    if (levels.empty() || levels.back() != s->priority) levels.push_back(s->priority);
  for (int level : levels) {
    schedule_running(level, /*decode=*/true, &budget, &scheduled, &plan);
    schedule_running(level, /*decode=*/false, &budget, &scheduled, &plan);
  }
  // A step whose rows ran out of blocks admits nothing; one that made way for a priority admits
  // that sequence alone.
  const bool out_of_blocks = !plan.preempted.empty();
  blocked_on_cache_ = out_of_blocks && !waiting_.empty();
  if (!out_of_blocks) {
    const int made_way = make_way_for_priority(&budget, &scheduled, &plan);
    admit_waiting(&budget, &plan, made_way);
  }
  build_batch(&plan);
  publish_waiting();
  return plan;
}

void Scheduler::schedule_running(int priority, bool decode, int* budget, std::set<SeqId>* scheduled,
                                 StepPlan* plan) {
  const std::vector<Sequence*> order = running_;  // preemption edits running_ as we go
  for (Sequence* s : order) {
    if (*budget == 0) return;
    if (s->priority != priority || !s->running || scheduled->count(s->id)) continue;
    const int remaining = int(s->tokens.size()) - s->n_computed;
    CEMLM_CHECK(remaining >= 1);
    if ((remaining == 1) != decode) continue;
    const int n = reserve(s, std::min(remaining, *budget), *scheduled, plan);
    if (n == 0) continue;
    scheduled->insert(s->id);
    *budget -= n;
    add_row(s, n, plan);
  }
}

int Scheduler::reserve(Sequence* s, int n, const std::set<SeqId>& scheduled, StepPlan* plan) {
  const bool decode = int(s->tokens.size()) - s->n_computed == 1;
  for (;;) {
    if (!decode) {
      // A prefill chunk first shrinks to the room left; it preempts only when none is left.
      const int64_t room =
          (int64_t(blocks_->table(s->id).size()) + blocks_->num_available()) *
              blocks_->block_size() - s->n_computed;
      if (room > 0) n = int(std::min<int64_t>(n, room));
    }
    if (blocks_->grow(s->id, s->n_computed + n)) return n;
    if (Sequence* v = victim_after(s, scheduled)) {
      preempt(v, plan);
      continue;
    }
    if (decode) preempt(s, plan);
    return 0;
  }
}

// Strictly by rank, even a victim whose preemption frees nothing (at a block boundary, with every
// block shared by a sequence admitted onto them while it sat a step out): it could not go on
// without a fresh block either, and its cache survives in its sharers' references, so its
// readmission recomputes one token. Skipping it would let it keep a slot over those ranked above it
// that are preempted next.
Sequence* Scheduler::victim_after(const Sequence* s, const std::set<SeqId>& scheduled) const {
  Sequence* v = nullptr;
  for (auto it = running_.rbegin(); it != running_.rend() && *it != s; ++it)
    if (!scheduled.count((*it)->id)) {
      v = *it;
      break;
    }
  // A scoring call runs between steps, never in one.
  Sequence* scoring = scoring_.empty() ? nullptr : scoring_.back().get();
  if (scoring && RankLess()(s, scoring) && (!v || RankLess()(v, scoring))) return scoring;
  return v;
}

Sequence* Scheduler::lowest_below(int priority, bool scoring) const {
  Sequence* v =
      !running_.empty() && running_.back()->priority < priority ? running_.back() : nullptr;
  Sequence* call = scoring && !scoring_.empty() && scoring_.back()->priority < priority
                       ? scoring_.back().get()
                       : nullptr;
  return call && (!v || RankLess()(v, call)) ? call : v;
}

void Scheduler::preempt(Sequence* s, StepPlan* plan) {
  blocks_->release(s->id);
  ++preemptions_;
  if (plan) plan->preempted.push_back(s->id);
  if (s->scoring) {
    preempted_scoring_.push_back(
        {s->id, blocks_->blocks_for(s->n_prompt), s->priority, s->arrival});
    scoring_.erase(std::find_if(scoring_.begin(), scoring_.end(),
                                [&](const auto& c) { return c.get() == s; }));
    return;
  }
  s->n_computed = 0;
  s->running = false;
  running_.erase(std::find(running_.begin(), running_.end(), s));
  waiting_.insert(s);
}

int Scheduler::make_way_for_priority(int* budget, std::set<SeqId>* scheduled, StepPlan* plan) {
  if (waiting_.empty() || (running_.empty() && scoring_.empty())) return 0;
  const Sequence* w = *waiting_.begin();
  // Blocks held for a scoring call ranked before it are not its to take: preempting for an
  // admission the hold refuses would throw work away for nothing.
  if (held_from(w)) return 0;
  // running_ is in rank order, so the sequences of lower priority are its tail.
  std::vector<SeqId> lower;
  int lower_rows = 0;  // budget their rows in this step hold
  for (auto it = running_.rbegin(); it != running_.rend() && (*it)->priority < w->priority; ++it) {
    lower.push_back((*it)->id);
    lower_rows += row_tokens(*plan, (*it)->id);
  }
  const size_t lower_sequences = lower.size();
  lower_scoring(w->priority, &lower);
  if (lower.empty()) return 0;
  const PrefixMatch match = blocks_->match_prefix(w->tokens, w->recursion, w->cache_salt);
  const int cached = int(match.blocks.size()) * blocks_->block_size();
  const int todo = int(w->tokens.size()) - cached;
  // The chunk it starts with: what the budget left gives, or a block's worth taken from the rows
  // of lower priority when less is left.
  const int n = std::min({todo, std::max(*budget, std::min(todo, blocks_->block_size())),
                          *budget + lower_rows});
  if (n <= 0) return 0;
  auto fits = [&](std::span<const SeqId> released, int64_t available) {
    return blocks_->start_cost(match, cached + n, released) <= available;
  };
  auto slot_and_blocks = [&] {
    return int(running_.size()) < opts_.max_running && fits({}, blocks_->num_available());
  };
  // Nothing to do when it fits as it is; nothing is done when it would not fit even once every
  // sequence and scoring call of lower priority made way (no work is thrown away for nothing).
  const bool slot_short = int(running_.size()) >= opts_.max_running;
  if ((*budget >= n && slot_and_blocks()) || (slot_short && lower_sequences == 0) ||
      !fits(lower, blocks_->reclaimable(lower)))
    return 0;
  auto leave_step = [&](SeqId id) {
    if (!scheduled->erase(id)) return;
    auto row = std::find_if(plan->rows.begin(), plan->rows.end(),
                            [&](const ScheduledRow& r) { return r.id == id; });
    *budget += row->n_tokens;
    plan->rows.erase(row);
  };
  // Budget: rows of lower priority sit this step out (keeping their cache), lowest rank first.
  for (SeqId id : lower) {
    if (*budget >= n) break;
    leave_step(id);
  }
  // A slot: sequences of lower priority are preempted, lowest rank first (each frees blocks too);
  // then blocks: they or scoring calls of lower priority, lowest rank first. (In rank order
  // throughout, a scoring call was preempted for blocks that the sequence preempted next for the
  // slot freed.)
  auto make_way = [&](bool scoring) {
    Sequence* v = lowest_below(w->priority, scoring);
    CEMLM_CHECK(v != nullptr);
    if (!v->scoring) leave_step(v->id);
    preempt(v, plan);
  };
  while (int(running_.size()) >= opts_.max_running) make_way(/*scoring=*/false);
  while (!fits({}, blocks_->num_available())) make_way(/*scoring=*/true);
  return n;
}

void Scheduler::admit_waiting(int* budget, StepPlan* plan, int only_first) {
  const int bs = blocks_->block_size();
  while (*budget > 0 && int(running_.size()) < opts_.max_running && !waiting_.empty()) {
    Sequence* s = *waiting_.begin();
    const PrefixMatch match = blocks_->match_prefix(s->tokens, s->recursion, s->cache_salt);
    const int cached = int(match.blocks.size()) * bs;
    int n = std::min(int(s->tokens.size()) - cached, *budget);
    if (only_first > 0) n = std::min(n, only_first);
    if ((held_from(s) &&
         blocks_->num_available() - blocks_->start_cost(match, cached + n) < held_for_scoring_) ||
        !blocks_->start(s->id, match, s->recursion, cached + n, s->cache_salt)) {
      blocked_on_cache_ = true;
      return;
    }
    waiting_.erase(waiting_.begin());
    s->n_computed = cached;
    s->running = true;
    running_.insert(std::upper_bound(running_.begin(), running_.end(), s, RankLess()), s);
    s->admitted_before = true;
    plan->admitted.push_back({s->id, cached});
    *budget -= n;
    add_row(s, n, plan);
    if (only_first > 0) return;  // what made way for it is not to be taken by the rest
  }
}

void Scheduler::add_row(Sequence* s, int n, StepPlan* plan) {
  plan->rows.push_back(
      {s->id, s->n_computed, n, s->n_computed + n == int(s->tokens.size())});
}

void Scheduler::build_batch(StepPlan* plan) const {
  auto recursion = [this](const ScheduledRow& r) { return seqs_.at(r.id)->recursion; };
  std::stable_sort(plan->rows.begin(), plan->rows.end(),
                   [&](const ScheduledRow& a, const ScheduledRow& b) {
                     return recursion(a) > recursion(b);
                   });
  plan->batch.seqs.clear();
  for (const ScheduledRow& r : plan->rows) {
    const Sequence& s = *seqs_.at(r.id);
    const std::vector<int32_t>& table = blocks_->table(r.id);
    BatchSeq b;
    b.tokens = s.tokens.data() + r.pos_begin;
    b.n_tokens = r.n_tokens;
    b.pos_begin = r.pos_begin;
    b.recursion = s.recursion;
    b.block_table = table.data();
    b.n_blocks = int(table.size());
    b.want_logits = r.sample;
    plan->batch.seqs.push_back(b);
  }
}

void Scheduler::complete(const StepPlan& plan) {
  for (const ScheduledRow& r : plan.rows) {
    Sequence& s = *seqs_.at(r.id);
    CEMLM_CHECK(s.n_computed == r.pos_begin);
    s.n_computed += r.n_tokens;
    blocks_->mark_computed(r.id, s.tokens, s.n_computed);
  }
}

void Scheduler::append(SeqId id, int token) { seqs_.at(id)->tokens.push_back(token); }

bool Scheduler::remove(SeqId id) {
  auto it = seqs_.find(id);
  if (it == seqs_.end()) return false;
  Sequence* s = it->second.get();
  if (s->running) {
    running_.erase(std::find(running_.begin(), running_.end(), s));
  } else {
    waiting_.erase(s);
    if (waiting_.empty()) blocked_on_cache_ = false;  // nothing is held back any more
  }
  blocks_->release(id);
  seqs_.erase(it);
  publish_waiting();
  return true;
}

bool Scheduler::make_room(int64_t n_blocks, int priority, uint64_t arrival) {
  // Waiting sequences ranked before the call keep the blocks they need to start (freed or
  // preempted), as they would before a generation request ranked where it is: a Score took those
  // of a finished request while higher-priority ones waited for them, and a later Score of a
  // priority those of an earlier request of it. (Only those blocks: one waiting for a
  // --max-running slot held off Scores on an empty cache.)
  int64_t wanted = 0;
  for (const Sequence* s : waiting_)
    if (s->priority > priority || (s->priority == priority && s->arrival < arrival))
      wanted += blocks_->blocks_for(int64_t(s->tokens.size()));
  if (wanted > 0 && blocks_->num_available() - n_blocks < wanted) return false;
  // running_ is in rank order, so the sequences of lower priority are its tail. Preempt only when
  // preempting all of them and the scoring calls of lower priority would make the room: otherwise
  // their work would be thrown away for a call that waits anyway.
  std::vector<SeqId> lower;
  for (auto it = running_.rbegin(); it != running_.rend() && (*it)->priority < priority; ++it)
    lower.push_back((*it)->id);
  lower_scoring(priority, &lower);
  if (blocks_->num_available() < n_blocks && blocks_->reclaimable(lower) < n_blocks) return false;
  while (blocks_->num_available() < n_blocks) {
    Sequence* v = lowest_below(priority, /*scoring=*/true);
    CEMLM_CHECK(v != nullptr);
    preempt(v, nullptr);
  }
  publish_waiting();
  return true;
}

void Scheduler::lower_scoring(int priority, std::vector<SeqId>* ids) const {
  for (auto it = scoring_.rbegin(); it != scoring_.rend() && (*it)->priority < priority; ++it)
    ids->push_back((*it)->id);
}

uint64_t Scheduler::take_arrival() {
  std::lock_guard<std::mutex> lock(intake_mu_);
  return next_arrival_++;
}

bool Scheduler::start_scoring(SeqId id, int n_tokens, int T, int priority, uint64_t arrival) {
  CEMLM_CHECK(!scoring(id));
  if (!make_room(blocks_->blocks_for(n_tokens), priority, arrival)) return false;
  CEMLM_CHECK(blocks_->start(id, {}, T, n_tokens));
  auto s = std::make_unique<Sequence>();
  s->id = id;
  s->n_prompt = n_tokens;
  s->recursion = T;
  s->priority = priority;
  s->arrival = arrival;
  s->running = true;
  s->scoring = true;
  auto at =
      std::upper_bound(scoring_.begin(), scoring_.end(), s.get(),
                       [](const Sequence* a, const auto& b) { return RankLess()(a, b.get()); });
  scoring_.insert(at, std::move(s));
  return true;
}

bool Scheduler::scoring(SeqId id) const {
  return std::any_of(scoring_.begin(), scoring_.end(), [&](const auto& s) { return s->id == id; });
}

void Scheduler::end_scoring(SeqId id) {
  blocks_->release(id);
  std::erase_if(scoring_, [&](const auto& s) { return s->id == id; });
}

}  // namespace cemlm
