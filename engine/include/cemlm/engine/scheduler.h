// Iteration-level continuous batching over the paged KV cache: which sequences run in the next
// engine step, with how many tokens each, and what gets preempted when blocks run out. Host-only;
// the engine feeds the resulting Batch to the ModelRunner and reports back with
// complete()/append().
//
// Policy, each step, under a budget of max_batch_tokens fed tokens:
//  1. rows of running sequences, priority by priority (highest first), so that rows of a lower
//     priority never hold back a higher one's prefill; within a priority, decode rows (sequences
//     that need one token) in rank order, then prefill chunks of sequences still prefilling, in
//     rank order, each as large as the budget left allows (chunked prefill);
//  2. priority: when the first waiting sequence does not fit (the budget left, max_running, or
//     the blocks of its first chunk) but would once running sequences of lower priority made way,
//     their rows sit this step out while budget is short (a block's worth at least), and they are
//     preempted while a slot is short, and they or scoring calls of lower priority while blocks
//     are, lowest rank first; that sequence is then the step's only admission. Equal priorities
//     never make way for each other (FCFS), and nothing is done for a sequence that would still
//     not fit;
//  3. admission of waiting sequences, in rank order, while the budget, max_running and the cache
//     allow; it stops at the first one that does not fit (no overtaking). Steps 2 and 3 are
//     skipped in a step whose rows ran out of blocks (and preempted for that).
// Rank = priority (higher first), then arrival (FCFS). When a running sequence needs a block and
// none is available, the lowest-ranked (newest) running sequence or scoring call ranked after it,
// and not yet in this step, is preempted by recompute: its blocks are freed and a sequence goes
// back to waiting with its arrival unchanged (so ahead of later arrivals), to be prefilled again
// over prompt + generated tokens (a scoring call starts over). With no such victim a decode row
// preempts itself and a prefill chunk shrinks to the blocks left or waits. The rows of a Batch are
// ordered by recursion T descending (the runner needs it).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "cemlm/engine/kv_blocks.h"
#include "cemlm/engine/model_runner.h"

namespace cemlm {

struct SchedulerOptions {
  int max_batch_tokens = 512;
  int max_running = 256;
  int max_waiting = 1024;
};

struct SeqSpec {
  SeqId id = 0;
  std::vector<int> prompt;
  int recursion = 1;
  int priority = 0;
  std::string cache_salt;  // its prefix-cache blocks are shared only with sequences of this salt
};

struct Sequence {
  SeqId id = 0;
  std::vector<int> tokens;  // prompt, then generated tokens
  int n_prompt = 0;
  int n_computed = 0;       // leading tokens whose cache entries exist
  int recursion = 1;
  int priority = 0;
  std::string cache_salt;
  uint64_t arrival = 0;
  bool running = false;
  bool admitted_before = false;  // admitted once already (now readmitted after a preemption)
  bool displaced = false;        // named by displace() for its owner to end
  bool scoring = false;  // a scoring call's blocks (Scheduler::start_scoring): n_prompt tokens
  int generated() const { return int(tokens.size()) - n_prompt; }
};

struct ScheduledRow {
  SeqId id = 0;
  int pos_begin = 0, n_tokens = 0;
  bool sample = false;  // the chunk ends the known tokens: its logits choose the next token
};

struct StepPlan {
  Batch batch;                       // one BatchSeq per row, same order; points into scheduler state
  std::vector<ScheduledRow> rows;    // ordered by recursion descending
  std::vector<SeqId> preempted;
  struct Admission {
    SeqId id;
    int cached_tokens;  // served from the prefix cache
  };
  std::vector<Admission> admitted;
  bool empty() const { return rows.empty(); }
};

class Scheduler {
 public:
  Scheduler(const SchedulerOptions& opts, BlockManager* blocks);

  // Thread-safe. RESOURCE_EXHAUSTED (naming max_waiting) when the waiting queue is full: when the
  // sequences not yet running would leave more than max_waiting of them waiting after the running
  // batch's free slots (max_running less those running) took theirs. A burst that fits the free
  // slots and the queue is accepted whole. Slots count as free only while the KV cache admits
  // the queue's first: when blocks are what holds it back, the queue's bound is max_waiting. A
  // sequence of higher priority than one queued and never admitted, and not claimed already by
  // another taken over the bound, is accepted even then: the next displace() displaces as many of
  // the lowest-ranked never-admitted ones (lowest priority, newest first) as the queue is then
  // still over its bound. The sequence joins the waiting queue at the next accept(), when its
  // owner is ready for it.
  absl::Status add(SeqSpec spec);
  // The rest is for the engine's step thread only. Moves the sequences added into the queue.
  void accept();
  // After accept() and the owner's removal of what its clients cancelled (a sequence taken over
  // the bound and cancelled at once makes nobody leave): the sequences displaced from a full
  // queue, still in it, for their owner to end (remove).
  std::vector<SeqId> displace();
  StepPlan schedule();
  // After the runner ran `plan`: the fed tokens are in the cache; full blocks are published.
  void complete(const StepPlan& plan);
  void append(SeqId id, int token);
  // Ends an accepted sequence wherever it is (waiting or running) and frees its blocks.
  bool remove(SeqId id);
  // Scoring calls: a prefill of all of their tokens whose chunks the engine runs between steps,
  // holding their blocks till they end. One is ranked like a sequence (its priority, then its
  // `arrival`, from take_arrival() when the call came) and preempted like one: by a running
  // sequence ranked above it that needs a block, by a waiting sequence of higher priority that
  // make-way admits, or by a scoring call of higher priority. Its blocks are then freed and
  // scoring(id) turns false: its owner starts it over. (A Score whose blocks could not be taken
  // made a running stream of higher priority preempt itself, and redo its tokens after it.)
  uint64_t take_arrival();  // thread-safe
  // Takes the blocks of `n_tokens` at depth T for scoring call `id`, making room as make_room
  // does; false, with nothing taken or preempted, where make_room makes none.
  bool start_scoring(SeqId id, int n_tokens, int T, int priority, uint64_t arrival);
  bool scoring(SeqId id) const;  // started and neither preempted nor ended
  void end_scoring(SeqId id);    // frees its blocks, if it still has them
  // The scoring calls preempted since the last call, for the engine to queue for room again (and
  // hold blocks for) before the next admission: one left unqueued until its owner noticed lost
  // its blocks to later requests of its priority, which it then waited for.
  struct ScoringClaim {
    SeqId id;
    int64_t blocks;
    int priority;
    uint64_t arrival;
  };
  std::vector<ScoringClaim> take_preempted_scoring() { return std::move(preempted_scoring_); }
  // Room for a scoring call of `priority` and `arrival`: preempts running sequences and scoring
  // calls of lower priority, lowest rank first, until `n_blocks` are available; false, with none
  // preempted, when even all of them would not free enough (equal and higher priorities are
  // never preempted: the call waits), or when it would leave fewer than the waiting sequences
  // ranked before it (higher priority, or its own and arrived earlier) need to start.
  bool make_room(int64_t n_blocks, int priority, uint64_t arrival = 0);
  // Blocks that admitting the waiting sequences ranked after a scoring call of `priority` and
  // `arrival` (lower priority, or its own and arrived later) must leave available (0: none), held
  // for the call while it waits for room, so that a stream of admissions cannot starve it.
  // (arrival 0: every waiting sequence of its priority.)
  void hold_for_scoring(int64_t n_blocks, int priority, uint64_t arrival = 0) {
    held_for_scoring_ = n_blocks;
    held_priority_ = priority;
    held_arrival_ = arrival;
  }

  const Sequence* find(SeqId id) const;
  bool has_work() const;  // anything running, waiting or not yet accepted
  int num_running() const { return int(running_.size()); }
  int num_scoring() const { return int(scoring_.size()); }  // scoring calls holding blocks
  int num_waiting() const;  // thread-safe
  int64_t preemptions_total() const { return preemptions_; }

 private:
  struct RankLess {
    bool operator()(const Sequence* a, const Sequence* b) const;
  };
  void publish_waiting();
  // Running slots a waiting sequence could take now: none while the cache holds the queue back.
  int free_slots() const;
  void publish_locked();  // publish_waiting's work, intake_mu_ held
  // Frees `s`'s blocks: a sequence goes back to waiting; a scoring call is gone (`s` with it).
  void preempt(Sequence* s, StepPlan* plan);
  // The lowest-ranked running sequence of priority below `priority` or, with `scoring`, scoring
  // call (nullptr: none).
  Sequence* lowest_below(int priority, bool scoring) const;
  // Appends the ids of the scoring calls of priority below `priority`, lowest rank first.
  void lower_scoring(int priority, std::vector<SeqId>* ids) const;
  // Makes way for the first waiting sequence when it does not fit (the budget left, max_running,
  // its first chunk's blocks) but would once running sequences of lower priority made way: their
  // rows sit this step out, lowest rank first, while budget is short; they are preempted while a
  // slot or blocks are. Returns the chunk it made way for (0: none), which admission caps that
  // sequence to, admitting no other in this step.
  int make_way_for_priority(int* budget, std::set<SeqId>* scheduled, StepPlan* plan);
  Sequence* victim_after(const Sequence* s, const std::set<SeqId>& scheduled) const;
  // Allocates blocks for `n` tokens of running `s`, preempting or shrinking per the policy.
  int reserve(Sequence* s, int n, const std::set<SeqId>& scheduled, StepPlan* plan);
  // The rows of the running sequences of `priority` that need one token (decode) or more.
  void schedule_running(int priority, bool decode, int* budget, std::set<SeqId>* scheduled,
                        StepPlan* plan);
  void admit_waiting(int* budget, StepPlan* plan, int only_first = 0);
  void add_row(Sequence* s, int n, StepPlan* plan);
  void build_batch(StepPlan* plan) const;

  SchedulerOptions opts_;
  BlockManager* blocks_;
  std::unordered_map<SeqId, std::unique_ptr<Sequence>> seqs_;
  std::set<Sequence*, RankLess> waiting_;
  std::vector<Sequence*> running_;  // sorted by rank
  std::vector<std::unique_ptr<Sequence>> scoring_;  // started scoring calls, sorted by rank
  std::vector<ScoringClaim> preempted_scoring_;     // for take_preempted_scoring
  int64_t preemptions_ = 0;
  // The last schedule() left the queue's first waiting for KV blocks (or for those held for a
  // scoring call), not for a slot or the step's budget.
  bool blocked_on_cache_ = false;
  int64_t held_for_scoring_ = 0;
  int held_priority_ = 0;
  uint64_t held_arrival_ = 0;
  // Whether the hold above keeps blocks from waiting sequence `s`.
  bool held_from(const Sequence* s) const {
    return held_for_scoring_ > 0 &&
           (s->priority < held_priority_ ||
            (s->priority == held_priority_ && s->arrival >= held_arrival_));
  }

  mutable std::mutex intake_mu_;
  std::vector<std::unique_ptr<Sequence>> intake_;
  int waiting_published_ = 0;     // waiting_ less the displaced as of the last change, for add()
  int free_slots_published_ = 0;  // free_slots(), likewise
  size_t accepted_claims_ = 0;    // the first of over_bound_, by sequences accept() took
  // Priorities of the waiting sequences never admitted (those a full queue may displace), in
  // ascending order, less those displace() named for displacement; likewise.
  std::vector<int> displaceable_published_;
  // The priorities of the sequences accepted into a full queue: displace() displaces one of lower
  // priority for each, where the queue is still over its bound.
  std::vector<int> over_bound_;
  uint64_t next_arrival_ = 0;
};

}  // namespace cemlm
