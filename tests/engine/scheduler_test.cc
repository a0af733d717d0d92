// Scheduler policy without a model: chunked prefill under the token budget, decode rows first,
// rank order (priority, then FCFS), the bounded queue, T-descending batches, and preemption of
// the newest running sequence when blocks run out.
#include "cemlm/engine/scheduler.h"

#include <gtest/gtest.h>

#include <climits>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "fake_runner.h"

namespace cemlm {
namespace {

std::vector<int> prompt(int n) {
  std::vector<int> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), 1);
  return t;
}

struct Harness {
  explicit Harness(SchedulerOptions o, int64_t blocks = 64, int bs = 4, bool caching = false)
      : bm(blocks, bs, caching), sched(o, &bm) {}
  void add(SeqId id, int n, int T = 1, int priority = 0) {
    ASSERT_TRUE(sched.add({id, prompt(n), T, priority}).ok());
  }
  // What the engine does first each step (it ends the displaced, returned, at once).
  std::vector<SeqId> accept() {
    sched.accept();
    return sched.displace();
  }
  // One step as the engine runs it: every sampling row gets token 7.
  StepPlan step() {
    accept();
    StepPlan plan = sched.schedule();
    sched.complete(plan);
    for (const auto& r : plan.rows)
      if (r.sample) sched.append(r.id, 7);
    return plan;
  }
  // B (priority 0, b_len prompt tokens) runs a step alone, then A (priority 1, a_len) arrives and
  // both run a step.
  void b_then_a(SeqId B, int b_len, SeqId A, int a_len) {
    add(B, b_len, 1, 0);
    step();
    add(A, a_len, 1, 1);
    step();
  }
  BlockManager bm;
  Scheduler sched;
};

int row_tokens(const StepPlan& p, SeqId id) {
  for (const auto& r : p.rows)
    if (r.id == id) return r.n_tokens;
  return 0;
}

TEST(Scheduler, ChunksPrefillUnderTheTokenBudget) {
  Harness h({.max_batch_tokens = 4});
  h.add(1, 10);
  StepPlan p = h.step();
  ASSERT_EQ(p.rows.size(), 1u);
  EXPECT_EQ(p.rows[0].pos_begin, 0);
  EXPECT_EQ(p.rows[0].n_tokens, 4);
  EXPECT_FALSE(p.rows[0].sample);
  EXPECT_FALSE(p.batch.seqs[0].want_logits);
  p = h.step();
  EXPECT_EQ(p.rows[0].pos_begin, 4);
  EXPECT_EQ(p.rows[0].n_tokens, 4);
  p = h.step();
  EXPECT_EQ(p.rows[0].n_tokens, 2);
  EXPECT_TRUE(p.rows[0].sample);
  EXPECT_TRUE(p.batch.seqs[0].want_logits);
  EXPECT_EQ(h.sched.num_waiting(), 0);
  EXPECT_TRUE(h.sched.has_work());  // running, nothing waiting
  p = h.step();  // decode
  EXPECT_EQ(p.rows[0].pos_begin, 10);
  EXPECT_EQ(p.rows[0].n_tokens, 1);
  EXPECT_EQ(h.sched.find(1)->tokens.size(), 12u);
}

TEST(Scheduler, DecodeRowsComeBeforePrefillChunks) {
  Harness h({.max_batch_tokens = 3});
  h.add(1, 2);
  h.step();  // 1 prefilled, sampled
  h.add(2, 10);
  h.add(3, 10);
  StepPlan p = h.step();
  EXPECT_EQ(row_tokens(p, 1), 1);
  EXPECT_EQ(row_tokens(p, 2), 2);
  EXPECT_EQ(row_tokens(p, 3), 0);
  p = h.step();  // 1 decodes, 2 continues before 3 is admitted
  EXPECT_EQ(row_tokens(p, 1), 1);
  EXPECT_EQ(row_tokens(p, 2), 2);
  EXPECT_EQ(row_tokens(p, 3), 0);
}

TEST(Scheduler, AdmitsByPriorityThenArrival) {
  Harness h({.max_batch_tokens = 2, .max_running = 1});
  h.add(1, 2, 1, 0);
  h.add(2, 2, 1, 5);
  h.add(3, 2, 1, 5);
  std::vector<SeqId> order;
  for (int i = 0; i < 3; ++i) {
    StepPlan p = h.step();
    ASSERT_EQ(p.admitted.size(), 1u);
    order.push_back(p.admitted[0].id);
    h.sched.remove(p.admitted[0].id);
  }
  EXPECT_EQ(order, (std::vector<SeqId>{2, 3, 1}));
}

TEST(Scheduler, MaxRunningBoundsTheRunningSet) {
  Harness h({.max_batch_tokens = 100, .max_running = 2});
  for (SeqId id = 1; id <= 4; ++id) h.add(id, 3);
  StepPlan p = h.step();
  EXPECT_EQ(p.rows.size(), 2u);
  EXPECT_EQ(h.sched.num_running(), 2);
  EXPECT_EQ(h.sched.num_waiting(), 2);
}

TEST(Scheduler, FullQueueIsResourceExhaustedNamingTheLimit) {
  Harness h({.max_running = 2, .max_waiting = 2});
  // A burst into an idle scheduler: two for the free running slots, two for the queue.
  for (SeqId id = 1; id <= 4; ++id) h.add(id, 3);
  const absl::Status st = h.sched.add({5, prompt(3), 1, 0});
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(st.message().find("--max-waiting = 2"), std::string::npos) << st;
  h.step();  // two admitted, two waiting: still full
  EXPECT_EQ(h.sched.num_running(), 2);
  EXPECT_EQ(h.sched.add({5, prompt(3), 1, 0}).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(h.sched.remove(1));  // a slot frees: room for one more
  EXPECT_TRUE(h.sched.add({5, prompt(3), 1, 0}).ok());
  EXPECT_EQ(h.sched.add({6, prompt(3), 1, 0}).code(), absl::StatusCode::kResourceExhausted);
}

// Free running slots let a burst in beyond max_waiting only while the KV cache admits the queue's
// first: with blocks holding it back, the slots were counted anyway and the queue held up to
// max_waiting + max_running - running.
TEST(Scheduler, SlotsTheCacheCannotFillDoNotWidenTheQueue) {
  Harness h({.max_batch_tokens = 100, .max_running = 8, .max_waiting = 2}, 4, 4);
  h.add(1, 12);  // 3 of the 4 blocks
  h.step();
  h.add(2, 12);  // waits for blocks, 7 slots free
  h.step();
  ASSERT_EQ(h.sched.num_running(), 1);
  ASSERT_EQ(h.sched.num_waiting(), 1);
  EXPECT_TRUE(h.sched.add({3, prompt(3), 1, 0}).ok());
  const absl::Status full = h.sched.add({4, prompt(3), 1, 0});
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_EQ(h.sched.num_waiting(), 2);
  // Blocks free: the queue starts, and the free slots count again.
  ASSERT_TRUE(h.sched.remove(1));
  h.step();
  EXPECT_EQ(h.sched.num_running(), 2);
  EXPECT_EQ(h.sched.num_waiting(), 0);
  for (SeqId id = 4; id < 4 + 6 + 2; ++id)  // 6 free slots and the queue: a burst fits whole
    EXPECT_TRUE(h.sched.add({id, prompt(3), 1, 0}).ok()) << id;
  EXPECT_EQ(h.sched.add({20, prompt(3), 1, 0}).code(), absl::StatusCode::kResourceExhausted);
}

// An idle scheduler whose last step left its queue waiting for blocks (the waiting one since
// cancelled): the free slots count again, for a burst into the empty engine.
TEST(Scheduler, AQueueHeldBackByTheCacheThenEmptiedLeavesTheSlotsFree) {
  Harness h({.max_batch_tokens = 100, .max_running = 8, .max_waiting = 2}, 4, 4);
  h.add(1, 12);
  h.step();
  h.add(2, 12);  // waits for blocks
  h.step();
  ASSERT_TRUE(h.sched.remove(2));
  ASSERT_TRUE(h.sched.remove(1));  // nothing runs or waits, and no step runs now
  for (SeqId id = 3; id < 3 + 5; ++id) EXPECT_TRUE(h.sched.add({id, prompt(3), 1, 0}).ok()) << id;
  h.sched.accept();  // the engine takes them in before its next step
  for (SeqId id = 8; id < 3 + 8 + 2; ++id)
    EXPECT_TRUE(h.sched.add({id, prompt(3), 1, 0}).ok()) << id;
  EXPECT_EQ(h.sched.add({20, prompt(3), 1, 0}).code(), absl::StatusCode::kResourceExhausted);
}

// The engine ends cancels and deadlines between accept() and displace(): arrivals meanwhile meet
// the queue as it is (they were checked against the queue before accept(), and passed), and a
// claim made meanwhile is settled at the next displace(), not dropped.
TEST(Scheduler, ArrivalsBetweenAcceptAndDisplaceMeetTheQueueAsItIs) {
  Harness h({.max_batch_tokens = 100, .max_running = 1, .max_waiting = 2}, 64, 4);
  h.add(1, 3);
  h.step();  // 1 runs
  h.add(2, 3);
  h.add(3, 3);
  h.sched.accept();  // 2 and 3 queued: full
  EXPECT_EQ(h.sched.add({4, prompt(3), 1, 0}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(h.sched.add({5, prompt(3), 1, 5}).ok());  // over the bound: claims 3
  EXPECT_TRUE(h.sched.displace().empty());              // 5 is not queued yet
  EXPECT_EQ(h.accept(), std::vector<SeqId>{3});
  ASSERT_TRUE(h.sched.remove(3));
  EXPECT_EQ(h.sched.num_waiting(), 2);  // 5 and 2
}

// Into a full queue, a sequence of higher priority than a queued never-admitted one is taken;
// displace() names the lowest-ranked of those (lowest priority, newest) for its owner to end. A
// preempted sequence keeps its place.
TEST(Scheduler, FullQueueDisplacesTheLowestRankedForAHigherPriority) {
  Harness h({.max_batch_tokens = 100, .max_running = 1, .max_waiting = 2}, 64, 4);
  h.add(1, 3);
  h.step();  // 1 runs
  h.add(2, 3, 1, 1);
  h.add(3, 3, 1, 0);
  h.step();  // 2 (priority 1) takes 1's slot; 1 (preempted) and 3 wait: full
  ASSERT_TRUE(h.sched.find(2)->running);
  EXPECT_EQ(h.sched.add({4, prompt(3), 1, 0}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(h.sched.add({5, prompt(3), 1, 1}).ok());  // above 3's priority
  EXPECT_EQ(h.accept(), std::vector<SeqId>{3});         // not 1, which was preempted
  EXPECT_EQ(h.sched.num_waiting(), 2);  // the displaced one no longer counts, before its removal
  ASSERT_TRUE(h.sched.remove(3));
  EXPECT_EQ(h.sched.num_waiting(), 2);
  // 1 and 5 (priority 1) wait: priority 1 is refused, priority 2 displaces 5.
  EXPECT_EQ(h.sched.add({6, prompt(3), 1, 1}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(h.sched.add({7, prompt(3), 1, 2}).ok());
  EXPECT_EQ(h.accept(), std::vector<SeqId>{5});
  ASSERT_TRUE(h.sched.remove(5));
  // Once 2 is preempted too, 7 is the only never-admitted sequence left to make way.
  ASSERT_TRUE(h.sched.make_room(64, 9));
  EXPECT_TRUE(h.sched.add({8, prompt(3), 1, 3}).ok());
  EXPECT_EQ(h.accept(), std::vector<SeqId>{7});
  ASSERT_TRUE(h.sched.remove(7));
  // With no never-admitted sequence queued, a full queue refuses every priority.
  h.step();
  EXPECT_EQ(h.sched.num_waiting(), 2);  // 2 and 1, preempted; 8 runs
  EXPECT_EQ(h.sched.add({9, prompt(3), 1, 50}).code(), absl::StatusCode::kResourceExhausted);
  // Taken into a full queue, but a slot frees before displace(): nobody is displaced.
  ASSERT_TRUE(h.sched.remove(2));
  h.add(10, 3);  // full again: 1 and 10
  EXPECT_TRUE(h.accept().empty());
  EXPECT_TRUE(h.sched.add({11, prompt(3), 1, 1}).ok());
  ASSERT_TRUE(h.sched.remove(8));  // the running one ends
  EXPECT_TRUE(h.accept().empty());
  EXPECT_EQ(h.sched.num_waiting(), 3);
}

// Each sequence taken into a full queue claims a lower-priority one to displace: one that is
// claimed already, or named by displace() and not yet removed, makes no room for another. (Two
// arrivals of priority 1 over a single queued priority 0 were both taken, and the second was
// displaced at once "by a request of higher priority".)
TEST(Scheduler, FullQueueTakesOnlyAsManyOverItsBoundAsItCanDisplace) {
  Harness h({.max_batch_tokens = 100, .max_running = 1, .max_waiting = 2}, 64, 4);
  h.add(1, 3, 1, 5);
  h.step();  // 1 runs
  h.add(2, 3, 1, 0);
  h.add(3, 3, 1, 1);
  h.step();                                             // 2 and 3 wait: full
  EXPECT_TRUE(h.sched.add({4, prompt(3), 1, 1}).ok());  // displaces 2
  EXPECT_EQ(h.sched.add({5, prompt(3), 1, 1}).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(h.sched.add({6, prompt(3), 1, 2}).ok());  // displaces 4, below it
  EXPECT_EQ(h.accept(), (std::vector<SeqId>{2, 4}));
  // Until their owner removes them, the displaced ones make no room either.
  EXPECT_EQ(h.sched.add({7, prompt(3), 1, 1}).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(h.sched.remove(2));
  ASSERT_TRUE(h.sched.remove(4));
  EXPECT_TRUE(h.accept().empty());
  EXPECT_EQ(h.sched.num_waiting(), 2);  // 6 and 3
}

// The sequence a full queue took one over its bound to displace may be admitted before accept()
// runs: then nothing of lower priority is left, and the newcomer must not displace itself (it
// was ended "by a request of higher priority" that did not exist).
TEST(Scheduler, AnArrivalOverTheBoundNeverDisplacesItsOwnPriority) {
  Harness h({.max_batch_tokens = 100, .max_running = 2, .max_waiting = 1}, 64, 4);
  h.add(1, 3, 1, 5);                      // A
  h.add(2, 3, 1, -1);                     // Z
  h.step();                               // both run
  ASSERT_TRUE(h.sched.make_room(63, 9));  // Z, the lowest ranked, is preempted
  ASSERT_FALSE(h.sched.find(2)->running);
  h.add(3, 3, 1, 0);                                    // X, never admitted
  EXPECT_TRUE(h.accept().empty());                      // X and Z wait, one slot free: full
  EXPECT_TRUE(h.sched.add({4, prompt(3), 1, 1}).ok());  // N, over the bound, to displace X
  StepPlan p = h.sched.schedule();                      // but X takes the free slot first
  h.sched.complete(p);
  ASSERT_TRUE(h.sched.find(3)->running);
  EXPECT_TRUE(h.accept().empty());  // N and Z (preempted) wait: nobody below N to displace
  EXPECT_FALSE(h.sched.find(4)->displaced);
  EXPECT_EQ(h.sched.num_waiting(), 2);
}

// --max-waiting and --max-running are only bounded by INT_MAX: their sum wrapped negative, and
// every submission was refused as over a full queue.
TEST(Scheduler, BoundsNearIntMaxDoNotOverflow) {
  for (const auto& [running, waiting] : {std::pair{2, INT_MAX}, {INT_MAX, 1}, {INT_MAX, INT_MAX}}) {
    Harness h({.max_batch_tokens = 100, .max_running = running, .max_waiting = waiting});
    for (SeqId id = 1; id <= 3; ++id)
      EXPECT_TRUE(h.sched.add({id, prompt(3), 1, 0}).ok()) << running << " " << waiting;
    EXPECT_TRUE(h.accept().empty());
    h.step();
    EXPECT_EQ(h.sched.num_running() + h.sched.num_waiting(), 3);
  }
}

TEST(Scheduler, BatchRowsAreOrderedByRecursionDescending) {
  Harness h({.max_batch_tokens = 100});
  h.add(1, 3, 1);
  h.add(2, 3, 4);
  h.add(3, 3, 2);
  h.add(4, 3, 4);
  const StepPlan p = h.step();
  ASSERT_EQ(p.batch.seqs.size(), 4u);
  std::vector<int> T;
  for (const auto& s : p.batch.seqs) T.push_back(s.recursion);
  EXPECT_EQ(T, (std::vector<int>{4, 4, 2, 1}));
  EXPECT_EQ(p.rows[0].id, 2u);  // stable within one T
  EXPECT_EQ(p.rows[1].id, 4u);
}

TEST(Scheduler, PreemptsTheNewestWhenBlocksRunOut) {
  // 4 blocks of 2: two sequences of 3 tokens take 2 blocks each; the next decode token of the
  // older one needs a third block, so the newer one is preempted by recompute.
  Harness h({.max_batch_tokens = 100}, 4, 2);
  h.add(1, 3);
  h.add(2, 3);
  h.step();  // both prefilled (positions 0..2), each sampled a token
  StepPlan p = h.step();  // both decode position 3: still inside block 2 of each
  EXPECT_TRUE(p.preempted.empty());
  p = h.step();  // position 4 needs a new block for each: 2 goes
  ASSERT_EQ(p.preempted, std::vector<SeqId>{2});
  EXPECT_EQ(row_tokens(p, 1), 1);
  EXPECT_EQ(h.sched.preemptions_total(), 1);
  const Sequence* s2 = h.sched.find(2);
  EXPECT_FALSE(s2->running);
  EXPECT_EQ(s2->n_computed, 0);
  EXPECT_EQ(s2->tokens.size(), 5u);  // prompt + generated kept for the recompute
  EXPECT_EQ(s2->generated(), 2);
  EXPECT_EQ(h.bm.num_available(), 1);
}

// A step whose rows ran out of blocks admits nothing, not even a higher priority that would fit
// in what the preemption freed; it is admitted at the next step.
TEST(Scheduler, NoAdmissionInAStepWhoseRowsRanOutOfBlocks) {
  Harness h({.max_batch_tokens = 100}, 4, 2);
  h.add(1, 3);
  h.add(2, 3);
  h.step();
  h.step();
  h.add(3, 2, 1, /*priority=*/1);
  StepPlan p = h.step();  // 1 needs a block: 2 goes, and 1 block is left, enough for 3
  ASSERT_EQ(p.preempted, std::vector<SeqId>{2});
  EXPECT_TRUE(p.admitted.empty());
  EXPECT_EQ(h.bm.num_available(), 1);
  p = h.step();
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].id, 3u);
}

TEST(Scheduler, PreemptedSequenceGoesAheadOfLaterArrivals) {
  Harness h({.max_batch_tokens = 100}, 4, 2);
  h.add(1, 3);
  h.add(2, 3);
  h.step();
  h.step();
  h.add(3, 1);
  StepPlan p = h.step();  // 2 preempted; no admission in this step
  ASSERT_EQ(p.preempted, std::vector<SeqId>{2});
  EXPECT_TRUE(p.admitted.empty());
  h.sched.remove(1);
  p = h.step();
  ASSERT_EQ(p.admitted.size(), 2u);
  EXPECT_EQ(p.admitted[0].id, 2u);
  EXPECT_EQ(row_tokens(p, 2), 5);  // recomputes prompt + generated, then samples
  EXPECT_TRUE(p.rows[0].sample);
}

// A preempted sequence readmitted finds its own blocks again (the engine then counts no hit: its
// prefix hits were those of its first admission).
TEST(Scheduler, ReadmissionAfterPreemptionFindsItsOwnBlocks) {
  Harness h({.max_batch_tokens = 100}, 6, 2, /*caching=*/true);
  h.add(1, 4);
  h.step();  // prompt [1, 4] computed; block [1, 2] published
  h.add(2, 5);
  StepPlan p = h.step();  // hits [1, 2] (2 prompt tokens) and [3, 4] (2 more)
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].cached_tokens, 4);
  for (int i = 0; i < 20 && h.sched.preemptions_total() == 0; ++i) h.step();  // blocks fill up
  ASSERT_EQ(h.sched.preemptions_total(), 1);
  ASSERT_FALSE(h.sched.find(2)->running);  // the newer one went
  h.sched.remove(1);
  p = h.step();  // 2 is readmitted and finds its own blocks
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_GT(p.admitted[0].cached_tokens, 0);
}

TEST(Scheduler, DecodeRowPreemptsItselfWhenNothingRanksBelowIt) {
  // B (priority 0) decodes; A (priority 1, admitted later but ranked first) prefills in chunks
  // and holds the rest of the cache. B's next block can only come from B itself.
  Harness h({.max_batch_tokens = 3}, 4, 2);
  const SeqId A = 1, B = 2;
  // B: positions 0-1, samples; then B decodes position 2 (2nd block), A admitted with 2 tokens
  h.b_then_a(B, 2, A, 8);
  StepPlan p = h.step();  // B position 3; A positions 2-3 (its 2nd block): cache full
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_EQ(h.bm.num_available(), 0);
  p = h.step();        // B needs a 3rd block: it yields it to A
  EXPECT_EQ(p.preempted, std::vector<SeqId>{B});
  EXPECT_EQ(row_tokens(p, B), 0);
  EXPECT_EQ(row_tokens(p, A), 3);
  EXPECT_TRUE(h.sched.find(A)->running);
}

// A decode row that needs a block nobody ranked below it can give preempts itself, even while the
// rows ranked above it fit (it does not keep its blocks and sit the step out).
TEST(Scheduler, DecodeRowPreemptsItselfWhileTheRowsAboveItFit) {
  Harness h({.max_batch_tokens = 100}, 4, 2);
  const SeqId A = 1, B = 2;
  // B: positions 0-2 (2 blocks), samples; then B decodes position 3, A admitted with 3 tokens
  // (2 blocks): cache full
  h.b_then_a(B, 3, A, 3);
  ASSERT_EQ(h.bm.num_available(), 0);
  const StepPlan p = h.step();  // A decodes position 3 in its block; B's position 4 needs a 3rd
  EXPECT_EQ(p.preempted, std::vector<SeqId>{B});
  EXPECT_EQ(row_tokens(p, A), 1);
  EXPECT_EQ(row_tokens(p, B), 0);
  EXPECT_FALSE(h.sched.find(B)->running);
  EXPECT_EQ(h.bm.num_available(), 2);
}

// A prefill chunk shrinks to the room its blocks and the free ones leave rather than preempt; with
// no room at all it preempts the lowest-ranked sequence not yet in the step.
TEST(Scheduler, PrefillChunkShrinksToTheRoomLeftAndPreemptsOnlyWhenNoneIsLeft) {
  Harness h({.max_batch_tokens = 4}, 6, 2);
  const SeqId L = 1, A = 2;
  h.add(L, 12, 1, 0);
  h.step();  // L: 4 tokens, 2 blocks
  h.add(A, 12, 1, 1);
  StepPlan p = h.step();  // L grows to 4 blocks, then sits out; A takes 2 tokens (1 block)
  ASSERT_EQ(row_tokens(p, A), 2);
  ASSERT_EQ(row_tokens(p, L), 0);
  ASSERT_EQ(h.bm.num_available(), 1);
  p = h.step();  // A: room for 2 tokens only (its block's 0 + 1 free block): shrinks, no preemption
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_EQ(row_tokens(p, A), 2);
  EXPECT_EQ(row_tokens(p, L), 2);  // within the blocks it holds
  ASSERT_EQ(h.bm.num_available(), 0);
  p = h.step();  // A: no room left: L, ranked below and not yet in the step, is preempted
  EXPECT_EQ(p.preempted, std::vector<SeqId>{L});
  EXPECT_EQ(row_tokens(p, A), 4);
  EXPECT_FALSE(h.sched.find(L)->running);
}

// The prefill chunk of a higher priority goes before a lower priority's decode row, and takes the
// last block: the decode row, with nobody ranked below it, yields. (The decode row went first and
// took the block, and the prefill waited.)
TEST(Scheduler, AHigherPrioritysPrefillTakesTheBlocksBeforeALowerDecodeRow) {
  Harness h({.max_batch_tokens = 3}, 4, 2);
  const SeqId A = 1, B = 2;
  h.b_then_a(B, 3, A, 8);  // B: 2 blocks; then B decodes position 3, A admitted with 2 tokens
  const StepPlan p = h.step();  // A's positions 2-3 take the last block; B's position 4 needs one
  EXPECT_EQ(p.preempted, std::vector<SeqId>{B});
  EXPECT_EQ(row_tokens(p, A), 2);
  EXPECT_EQ(row_tokens(p, B), 0);
  EXPECT_TRUE(h.sched.find(A)->running);
  EXPECT_EQ(p.batch.seqs.size(), 1u);
}

// Sequences of higher priority that fit as they are need nobody to make way: all of them are
// admitted in one step.
TEST(Scheduler, HigherPriorityArrivalsThatFitAreAllAdmittedTogether) {
  Harness h({.max_batch_tokens = 100});
  h.add(1, 3);
  h.step();
  h.add(2, 3, 1, 1);
  h.add(3, 3, 1, 1);
  const StepPlan p = h.step();
  EXPECT_TRUE(p.preempted.empty());
  ASSERT_EQ(p.admitted.size(), 2u);
  EXPECT_EQ(p.admitted[0].id, 2u);
  EXPECT_EQ(p.admitted[1].id, 3u);
  EXPECT_EQ(row_tokens(p, 1), 1);
}

// Once admitted, a sequence of higher priority keeps getting the budget: decode rows of lower
// priority come after its prefill chunks. (They came first, in every step, so that its prefill
// stalled until they had finished decoding.)
TEST(Scheduler, DecodeRowsOfLowerPriorityDoNotStallAHigherPrioritysPrefill) {
  Harness h({.max_batch_tokens = 2});
  h.add(1, 1);
  h.add(2, 1);
  h.step();  // both sample: decoding from now on
  h.add(3, 10, 1, /*priority=*/1);
  StepPlan p = h.step();  // 1 and 2 sit out for 3's first chunk
  ASSERT_EQ(row_tokens(p, 3), 2);
  for (int pos = 2; pos < 10; pos += 2) {
    p = h.step();
    EXPECT_EQ(row_tokens(p, 3), 2) << "position " << pos;
    EXPECT_EQ(row_tokens(p, 1) + row_tokens(p, 2), 0) << "position " << pos;
  }
  EXPECT_TRUE(p.rows[0].sample);
  p = h.step();  // 3 decodes; 1 takes the budget left
  EXPECT_EQ(row_tokens(p, 3), 1);
  EXPECT_EQ(row_tokens(p, 1), 1);
  EXPECT_TRUE(h.sched.find(1)->running && h.sched.find(2)->running);
  EXPECT_EQ(h.sched.preemptions_total(), 0);
}

// When budget is short, the lowest-ranked row of lower priority sits out first, and only as many
// as the chunk needs.
TEST(Scheduler, RowsOfLowerPrioritySitOutLowestRankFirst) {
  Harness h({.max_batch_tokens = 3});
  h.add(1, 1);
  h.add(2, 1);
  h.step();  // both sample: decoding from now on
  h.add(3, 2, 1, /*priority=*/1);
  const StepPlan p = h.step();  // two decode rows leave 1 token; 3 needs 2
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_EQ(row_tokens(p, 1), 1);
  EXPECT_EQ(row_tokens(p, 2), 0);
  EXPECT_EQ(row_tokens(p, 3), 2);
}

// The chunk made way for is the one admitted: the budget a lower row gave back beyond it is not
// taken, since only that chunk's blocks were checked (here a larger one would not fit, and the
// lower row would have sat out for nothing).
TEST(Scheduler, AdmissionAfterMakingWayTakesTheChunkMadeWayFor) {
  Harness h({.max_batch_tokens = 8}, 5, 4);
  const SeqId L = 1, H = 2;
  h.add(L, 16);
  h.step();  // L: 8 tokens, 2 blocks
  h.add(H, 20, 1, /*priority=*/1);
  const StepPlan p = h.step();  // L's row grows it to 4 blocks and takes the budget: 1 block left
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].id, H);
  EXPECT_EQ(row_tokens(p, H), 4);  // a block's worth
  EXPECT_EQ(row_tokens(p, L), 0);
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_EQ(h.bm.num_available(), 0);
}

// With no budget left to admit it (rows of higher priority took it all, and the lower one has no
// row to give back), a waiting sequence of higher priority makes nobody leave: nothing is preempted
// for an admission that cannot happen in this step.
TEST(Scheduler, NothingIsPreemptedForAPriorityWithNoBudgetToAdmitIt) {
  Harness h({.max_batch_tokens = 2, .max_running = 2}, 64, 4);
  const SeqId L = 1, H = 2, W = 3;
  h.add(L, 20, 1, 0);
  h.step();  // L prefills 2 tokens a step
  h.add(H, 10, 1, 2);
  h.add(W, 2, 1, 1);
  StepPlan p = h.step();  // H takes L's budget; W waits
  ASSERT_EQ(row_tokens(p, H), 2);
  ASSERT_EQ(h.sched.num_running(), 2);
  p = h.step();  // H's chunk takes the whole budget; L has no row; W cannot be fed anyway
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_TRUE(p.admitted.empty());
  EXPECT_TRUE(h.sched.find(L)->running);
  EXPECT_EQ(h.sched.preemptions_total(), 0);
}

// A higher priority whose prompt the prefix cache mostly holds needs only its uncached tokens:
// with the budget a lower decode row leaves, it is admitted as it is, nobody making way.
TEST(Scheduler, HigherPriorityArrivalServedByThePrefixCacheFitsAsItIs) {
  Harness h({.max_batch_tokens = 2}, 64, 2, /*caching=*/true);
  h.add(1, 6);
  for (int i = 0; i < 3; ++i) h.step();  // prefilled (3 full blocks published), sampled
  h.add(2, 7, 1, /*priority=*/1);         // the same 6 tokens, then one more
  const StepPlan p = h.step();
  EXPECT_TRUE(p.preempted.empty());
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].id, 2u);
  EXPECT_EQ(p.admitted[0].cached_tokens, 6);
  EXPECT_EQ(row_tokens(p, 1), 1);
  EXPECT_EQ(row_tokens(p, 2), 1);
}

TEST(Scheduler, HigherPriorityArrivalPreemptsTheLowestRankedForASlot) {
  Harness h({.max_batch_tokens = 100, .max_running = 2});
  h.add(1, 3);
  h.add(2, 3);
  h.step();  // both prefilled
  h.add(3, 3, 1, /*priority=*/5);
  StepPlan p = h.step();
  ASSERT_EQ(p.preempted, std::vector<SeqId>{2});  // the newer of the two
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].id, 3u);
  EXPECT_EQ(row_tokens(p, 1), 1);  // 1 still decodes in this step
  EXPECT_EQ(row_tokens(p, 2), 0);  // 2's decode row left the step
  EXPECT_EQ(row_tokens(p, 3), 3);
  const Sequence* s2 = h.sched.find(2);
  EXPECT_FALSE(s2->running);
  EXPECT_EQ(s2->n_computed, 0);
  EXPECT_EQ(s2->generated(), 1);  // kept for the recompute
  EXPECT_FALSE(h.bm.has(2));
  h.sched.remove(3);
  p = h.step();  // 2 comes back, recomputing prompt + generated
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].id, 2u);
  EXPECT_EQ(row_tokens(p, 2), 4);
}

TEST(Scheduler, EqualPriorityArrivalWaitsItsTurn) {
  Harness h({.max_batch_tokens = 100, .max_running = 2});
  h.add(1, 3, 1, 2);
  h.add(2, 3, 1, 2);
  h.step();
  h.add(3, 3, 1, 2);
  const StepPlan p = h.step();
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_TRUE(p.admitted.empty());
  EXPECT_EQ(h.sched.num_waiting(), 1);
}

TEST(Scheduler, HigherPriorityArrivalPreemptsOnlyWhatItsBlocksNeed) {
  // 6 blocks of 2: three sequences of 3 tokens hold 2 each. A 2-token arrival of higher priority
  // needs one block: the lowest-ranked sequence alone makes way.
  Harness h({.max_batch_tokens = 100}, 6, 2);
  h.add(1, 3);
  h.add(2, 3);
  h.add(3, 3);
  h.step();
  h.add(4, 2, 1, /*priority=*/1);
  const StepPlan p = h.step();
  ASSERT_EQ(p.preempted, std::vector<SeqId>{3});
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].id, 4u);
  EXPECT_EQ(row_tokens(p, 1), 1);
  EXPECT_EQ(row_tokens(p, 2), 1);
  EXPECT_EQ(h.bm.num_available(), 1);
}

TEST(Scheduler, NothingIsPreemptedForAnArrivalThatStillWouldNotFit) {
  // 4 blocks of 2: 1 (priority 5) and 2 (priority 0) hold 2 each. 3 (priority 1) needs 3 blocks
  // for its 5 tokens; only 2's two would make way, so 2 keeps running and 3 waits.
  Harness h({.max_batch_tokens = 100}, 4, 2);
  h.add(1, 3, 1, 5);
  h.add(2, 3, 1, 0);
  h.step();
  h.add(3, 5, 1, 1);
  const StepPlan p = h.step();
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_TRUE(p.admitted.empty());
  EXPECT_EQ(row_tokens(p, 2), 1);
  h.sched.remove(1);
  const StepPlan q = h.step();  // now 2 making way is enough
  ASSERT_EQ(q.preempted, std::vector<SeqId>{2});
  ASSERT_EQ(q.admitted.size(), 1u);
  EXPECT_EQ(q.admitted[0].id, 3u);
}

// The sequence preempted for a priority is not readmitted in the same step (it would take back
// the blocks it gave up, to be preempted again at the next step, its recompute wasted).
TEST(Scheduler, APreemptedSequenceIsNotReadmittedInTheStepThatPreemptedIt) {
  Harness h({.max_batch_tokens = 8}, 4, 2);
  h.add(1, 7);
  h.step();  // 1 holds all 4 blocks
  h.add(2, 2, 1, /*priority=*/1);
  StepPlan p = h.step();
  ASSERT_EQ(p.preempted, std::vector<SeqId>{1});
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].id, 2u);
  EXPECT_EQ(row_tokens(p, 1), 0);
  p = h.step();  // 2 decodes; 1 waits for room instead of thrashing
  EXPECT_TRUE(p.preempted.empty());
  EXPECT_EQ(row_tokens(p, 2), 1);
}

// When only the token budget is short, rows of lower priority sit the step out and keep their
// cache: nothing is preempted.
TEST(Scheduler, BudgetForAPriorityComesFromRowsNotPreemption) {
  Harness h({.max_batch_tokens = 4});
  h.add(1, 20);
  h.step();
  h.step();  // 1 has 8 tokens computed and prefills 4 a step
  h.add(2, 3, 1, /*priority=*/1);
  StepPlan p = h.step();
  EXPECT_TRUE(p.preempted.empty());
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(row_tokens(p, 2), 3);
  EXPECT_EQ(row_tokens(p, 1), 0);
  EXPECT_EQ(h.sched.find(1)->n_computed, 8);
  EXPECT_EQ(h.sched.preemptions_total(), 0);
  p = h.step();  // 2 decodes, 1 goes on where it was
  EXPECT_EQ(row_tokens(p, 2), 1);
  ASSERT_EQ(row_tokens(p, 1), 3);
  EXPECT_EQ(p.rows[1].pos_begin, 8);
}

// Room for a scoring call preempts running sequences of lower priority only, lowest rank first,
// and nobody when that would not make the room.
TEST(Scheduler, MakeRoomPreemptsOnlyLowerPrioritiesLowestRankFirst) {
  Harness h({.max_batch_tokens = 100}, 6, 2);
  h.add(1, 4, 1, 1);
  h.add(2, 4, 1, 0);
  h.add(3, 4, 1, 2);
  h.step();  // 6 blocks used
  EXPECT_EQ(h.bm.num_available(), 0);
  EXPECT_FALSE(h.sched.make_room(2, 0));  // an equal priority is never preempted: the call waits
  EXPECT_EQ(h.sched.num_running(), 3);
  EXPECT_TRUE(h.sched.make_room(2, 1));
  EXPECT_FALSE(h.sched.find(2)->running);
  EXPECT_TRUE(h.sched.find(1)->running);
  EXPECT_TRUE(h.sched.find(3)->running);
  // Of priority 2, only sequence 1 is lower: 2 free + its 2 are not 5, so nobody is preempted.
  EXPECT_FALSE(h.sched.make_room(5, 2));
  EXPECT_EQ(h.sched.num_running(), 2);
  EXPECT_TRUE(h.sched.make_room(4, 2));
  EXPECT_FALSE(h.sched.find(1)->running);
  EXPECT_TRUE(h.sched.find(3)->running);
  // 7 of 6 blocks can never be made: nobody is preempted for nothing.
  EXPECT_FALSE(h.sched.make_room(7, 3));
  EXPECT_EQ(h.sched.num_running(), 1);
  EXPECT_EQ(h.sched.num_waiting(), 2);
  EXPECT_TRUE(h.sched.make_room(6, 3));
  EXPECT_EQ(h.sched.num_running(), 0);
  EXPECT_EQ(h.sched.num_waiting(), 3);
}

// Blocks held for a waiting scoring call are not given to admissions of its priority or lower,
// so a stream of new requests cannot starve it; a higher priority is admitted into them.
TEST(Scheduler, BlocksHeldForScoringAreNotGivenToAdmissionsOfItsPriority) {
  Harness h({.max_batch_tokens = 100}, 8, 2);
  h.sched.hold_for_scoring(6, 0);
  h.add(1, 4);  // 2 blocks: 6 left, as held
  h.add(2, 4);  // would leave 4
  h.step();
  EXPECT_TRUE(h.sched.find(1)->running);
  EXPECT_FALSE(h.sched.find(2)->running);
  h.add(3, 4, 1, 1);
  h.step();
  EXPECT_TRUE(h.sched.find(3)->running);
  EXPECT_FALSE(h.sched.find(2)->running);
  h.sched.hold_for_scoring(0, 0);
  h.step();
  EXPECT_TRUE(h.sched.find(2)->running);
}

// A scoring call is ranked among the waiting sequences by its priority, then its arrival: its
// hold keeps blocks from those of its priority that came after it, not from one that came before
// (a later Score took the blocks an earlier request of its priority waited for), and its room
// leaves that one's blocks.
TEST(Scheduler, AScoringCallWaitsBehindEarlierRequestsOfItsPriority) {
  Harness h({.max_batch_tokens = 100}, 8, 2);
  h.add(1, 14);  // runs, 7 of the 8 blocks
  h.step();
  h.add(2, 8);  // waits for 4 blocks
  const uint64_t score_arrival = h.sched.take_arrival();
  h.add(3, 8);  // after the call
  h.sched.hold_for_scoring(6, 0, score_arrival);
  h.step();  // both wait: 1 block free
  EXPECT_FALSE(h.sched.find(2)->running);
  EXPECT_FALSE(h.sched.make_room(6, 0, score_arrival));
  h.sched.remove(1);  // 8 free
  // The call's room would leave fewer than the earlier request needs: it waits.
  EXPECT_FALSE(h.sched.make_room(6, 0, score_arrival));
  h.step();
  EXPECT_TRUE(h.sched.find(2)->running);   // the earlier one is admitted
  EXPECT_FALSE(h.sched.find(3)->running);  // the later one is held for the call
  EXPECT_EQ(h.bm.num_available(), 4);
  EXPECT_FALSE(h.sched.make_room(6, 0, score_arrival));
  h.sched.remove(2);
  EXPECT_TRUE(h.sched.make_room(6, 0, score_arrival));  // 8 free: the call's 6, the later one waits
}

// A waiting sequence that the hold would not admit does not make lower priorities make way for
// it either: their work would be thrown away for nothing.
TEST(Scheduler, NoPreemptionForAnAdmissionTheScoringHoldRefuses) {
  Harness h({.max_batch_tokens = 100, .max_running = 1}, 8, 2);
  h.add(1, 4, 1, 0);
  h.step();
  h.sched.hold_for_scoring(6, 1);
  h.add(2, 4, 1, 1);  // would preempt sequence 1 for the running slot, but the hold refuses it
  h.step();
  EXPECT_TRUE(h.sched.find(1)->running);
  EXPECT_FALSE(h.sched.find(2)->running);
  EXPECT_EQ(h.sched.preemptions_total(), 0);
  h.sched.hold_for_scoring(0, 0);
  h.step();
  EXPECT_TRUE(h.sched.find(2)->running);
  EXPECT_EQ(h.sched.preemptions_total(), 1);
}

// Blocks another holder keeps (a scoring call's) cannot be made room from: when the running
// sequences' own blocks are not enough, none of them is preempted. Blocks two running sequences
// share (a prefix-cache hit) count once and are freed with the second.
TEST(Scheduler, MakeRoomCountsOnlyWhatPreemptingWouldFree) {
  Harness h({.max_batch_tokens = 100}, 8, 2, /*caching=*/true);
  h.add(1, 5);
  h.step();  // 3 blocks; the first two published
  h.add(2, 5);
  h.step();  // shares those two, adds 1
  ASSERT_EQ(h.bm.num_available(), 4);
  const SeqId other = 999;  // not a scheduler sequence: a scoring call, say
  ASSERT_TRUE(h.bm.start(other, {}, 1, 4));  // 2 blocks
  EXPECT_EQ(h.bm.num_available(), 2);
  EXPECT_FALSE(h.sched.make_room(7, 1));  // 2 free + 4 of the running = 6
  EXPECT_EQ(h.sched.num_running(), 2);
  EXPECT_TRUE(h.sched.make_room(6, 1));
  EXPECT_EQ(h.sched.num_running(), 0);
  h.bm.release(other);
}

// A scoring call's blocks are preempted like a sequence's, by rank: a running sequence ranked
// above it takes them when it needs a block (it preempted itself instead, and redid its tokens
// after the call), one ranked below preempts itself; the call's owner sees it gone.
TEST(Scheduler, ARunningSequenceRankedAboveAScoringCallTakesItsBlocks) {
  struct Case {
    int seq_priority, call_priority;
    bool call_first;  // the call's arrival is before the sequence's
    bool call_preempted;
  };
  for (const Case& k : {Case{5, 0, true, true}, Case{0, 0, false, true}, Case{0, 0, true, false},
                        Case{0, 5, false, false}}) {
    SCOPED_TRACE(::testing::Message()
                 << k.seq_priority << " " << k.call_priority << " " << k.call_first);
    Harness h({.max_batch_tokens = 100}, 6, 2);
    const uint64_t early = h.sched.take_arrival();
    h.add(1, 4, 1, k.seq_priority);  // 2 blocks, full: its first token needs a third
    const uint64_t late = h.sched.take_arrival();
    h.step();
    const SeqId call = 999;
    ASSERT_TRUE(h.sched.start_scoring(call, 8, 2, k.call_priority, k.call_first ? early : late));
    ASSERT_TRUE(h.sched.scoring(call));
    ASSERT_EQ(h.bm.num_available(), 0);
    StepPlan p = h.step();
    EXPECT_EQ(h.sched.preemptions_total(), 1);
    EXPECT_EQ(h.sched.scoring(call), !k.call_preempted);
    EXPECT_EQ(h.sched.find(1)->running, k.call_preempted);
    EXPECT_EQ(row_tokens(p, 1), k.call_preempted ? 1 : 0);
    EXPECT_EQ(p.preempted, std::vector<SeqId>{k.call_preempted ? call : 1});
    EXPECT_EQ(h.bm.num_available(), k.call_preempted ? 3 : 2);
    h.sched.end_scoring(call);  // as its owner does, preempted or not
    EXPECT_EQ(h.bm.num_available(), k.call_preempted ? 3 : 6);
    EXPECT_FALSE(h.sched.scoring(call));
  }
}

// Of the sequences and scoring calls ranked after a sequence that needs a block, the lowest
// ranked goes first.
TEST(Scheduler, TheLowestRankedOfSequencesAndScoringCallsIsPreemptedFirst) {
  for (int call_priority : {1, 3}) {
    Harness h({.max_batch_tokens = 100}, 8, 2);
    h.add(1, 4, 1, 4);  // A: 2 blocks, its first token needs a third
    h.add(2, 3, 1, 2);  // B: 2 blocks
    h.step();
    const SeqId call = 999;
    ASSERT_TRUE(h.sched.start_scoring(call, 8, 1, call_priority, h.sched.take_arrival()));
    ASSERT_EQ(h.bm.num_available(), 0);
    h.step();
    EXPECT_TRUE(h.sched.find(1)->running);
    EXPECT_EQ(h.sched.preemptions_total(), 1);
    // Below B (priority 2), the call goes; above it, B does.
    EXPECT_EQ(h.sched.scoring(call), call_priority > 2) << call_priority;
    EXPECT_EQ(h.sched.find(2)->running, call_priority < 2) << call_priority;
    h.sched.end_scoring(call);
  }
}

// A waiting sequence of higher priority is admitted into a lower-priority scoring call's blocks,
// as into a lower-priority sequence's; but a call holds no running slot, so none is preempted for
// one.
TEST(Scheduler, AHigherPriorityAdmissionPreemptsAScoringCallForBlocksNotForASlot) {
  {
    Harness h({.max_batch_tokens = 100}, 6, 2);
    const SeqId call = 999;
    ASSERT_TRUE(h.sched.start_scoring(call, 12, 1, 0, h.sched.take_arrival()));
    h.add(1, 4, 1, 0);  // its own priority waits for the call
    h.step();
    EXPECT_FALSE(h.sched.find(1)->running);
    EXPECT_TRUE(h.sched.scoring(call));
    h.add(2, 4, 1, 1);
    StepPlan p = h.step();
    EXPECT_TRUE(h.sched.find(2)->running);
    EXPECT_FALSE(h.sched.scoring(call));
    EXPECT_EQ(p.preempted, std::vector<SeqId>{call});
    EXPECT_EQ(h.sched.preemptions_total(), 1);
    h.sched.end_scoring(call);
  }
  {
    Harness h({.max_batch_tokens = 100, .max_running = 1}, 6, 2);
    h.add(1, 2, 1, 5);  // holds the only slot
    h.step();
    const SeqId call = 999;
    ASSERT_TRUE(h.sched.start_scoring(call, 8, 1, 0, h.sched.take_arrival()));
    h.add(2, 2, 1, 1);  // needs the slot, which preempting the call would not give
    h.step();
    EXPECT_FALSE(h.sched.find(2)->running);
    EXPECT_TRUE(h.sched.scoring(call));
    EXPECT_EQ(h.sched.preemptions_total(), 0);
    h.sched.end_scoring(call);
  }
}

// When a slot and blocks are both short, sequences go first for the slot: the one that frees both
// is enough (in rank order, the lower-ranked call went first for blocks that the sequence then
// preempted for the slot freed anyway).
TEST(Scheduler, MakeWayPreemptsForTheSlotBeforeTheBlocks) {
  Harness h({.max_batch_tokens = 100, .max_running = 1}, 4, 4);
  h.add(1, 3, 1, 0);  // 1 block
  h.step();
  const SeqId call = 999;
  ASSERT_TRUE(h.sched.start_scoring(call, 12, 1, 0, h.sched.take_arrival()));  // 3 blocks
  ASSERT_EQ(h.bm.num_available(), 0);
  h.add(2, 4, 1, 1);  // a slot and 1 block
  h.step();
  EXPECT_TRUE(h.sched.find(2)->running);
  EXPECT_FALSE(h.sched.find(1)->running);
  EXPECT_TRUE(h.sched.scoring(call)) << "preempted for nothing";
  EXPECT_TRUE(h.sched.take_preempted_scoring().empty());
  h.sched.end_scoring(call);
}

// A preempted scoring call is handed back to its owner's queue with its size, priority and rank.
TEST(Scheduler, APreemptedScoringCallIsHandedBackToBeQueued) {
  Harness h({.max_batch_tokens = 100}, 6, 2);
  h.add(1, 4, 1, 5);
  h.step();
  const uint64_t arrival = h.sched.take_arrival();
  ASSERT_TRUE(h.sched.start_scoring(999, 7, 1, 0, arrival));  // 4 blocks
  EXPECT_TRUE(h.sched.take_preempted_scoring().empty());
  h.step();  // sequence 1 needs a third block
  const auto claims = h.sched.take_preempted_scoring();
  ASSERT_EQ(claims.size(), 1u);
  EXPECT_EQ(claims[0].id, 999u);
  EXPECT_EQ(claims[0].blocks, 4);
  EXPECT_EQ(claims[0].priority, 0);
  EXPECT_EQ(claims[0].arrival, arrival);
  EXPECT_TRUE(h.sched.take_preempted_scoring().empty());  // handed over once
}

// Room for a scoring call preempts scoring calls of lower priority, lowest rank first, never one
// of its own priority.
TEST(Scheduler, MakeRoomPreemptsLowerPriorityScoringCalls) {
  Harness h({.max_batch_tokens = 100}, 6, 2);
  ASSERT_TRUE(h.sched.start_scoring(901, 4, 1, 1, h.sched.take_arrival()));  // 2 blocks
  ASSERT_TRUE(h.sched.start_scoring(902, 4, 1, 0, h.sched.take_arrival()));
  ASSERT_TRUE(h.sched.start_scoring(903, 4, 1, 1, h.sched.take_arrival()));
  EXPECT_FALSE(h.sched.start_scoring(904, 4, 1, 0, h.sched.take_arrival()));
  EXPECT_TRUE(h.sched.scoring(902));
  EXPECT_FALSE(h.sched.start_scoring(905, 6, 1, 1, h.sched.take_arrival()));  // 3 blocks
  EXPECT_TRUE(h.sched.scoring(902));  // its 2 would not do: not preempted for nothing
  EXPECT_TRUE(h.sched.start_scoring(906, 2, 1, 2, h.sched.take_arrival()));
  EXPECT_FALSE(h.sched.scoring(902));  // the lowest ranked
  EXPECT_TRUE(h.sched.scoring(901));
  EXPECT_TRUE(h.sched.scoring(903));
  EXPECT_TRUE(h.sched.start_scoring(907, 6, 1, 2, h.sched.take_arrival()));
  EXPECT_FALSE(h.sched.scoring(903));  // of priority 1, the later
  EXPECT_TRUE(h.sched.scoring(901));
  EXPECT_EQ(h.sched.preemptions_total(), 2);
  for (SeqId id : {901, 906, 907}) h.sched.end_scoring(id);
  EXPECT_EQ(h.bm.num_available(), 6);
}

// A victim whose preemption frees nothing (every block shared, at a block boundary) is still
// preempted in rank order; its cache lives on in the sharer's references, so readmission
// recomputes one token.
TEST(Scheduler, AVictimThatFreesNothingIsReadmittedOntoItsCache) {
  Harness h({.max_batch_tokens = 3}, 10, 1, /*caching=*/true);
  ASSERT_TRUE(h.sched.add({1, {11, 12, 13, 14, 15}, 1, 0}).ok());
  h.step();
  ASSERT_TRUE(h.sched.add({2, prompt(10), 1, 1}).ok());
  h.step();  // 1 ends its prompt; 2 is admitted into the budget left
  ASSERT_TRUE(h.sched.add({3, {11, 12, 13, 14, 15, 99}, 1, 2}).ok());
  StepPlan p = h.step();  // 2's prefill takes the budget; it sits out for 3, 1 gets no row
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].cached_tokens, 5);  // 3 shares all five of 1's blocks
  EXPECT_EQ(row_tokens(p, 1), 0);
  ASSERT_EQ(h.bm.num_available(), 0);
  p = h.step();  // 3's decode needs a block: 1 (freeing nothing), then 2 make way
  EXPECT_EQ(p.preempted, (std::vector<SeqId>{1, 2}));
  h.sched.remove(2);
  p = h.step();
  ASSERT_EQ(p.admitted.size(), 1u);
  EXPECT_EQ(p.admitted[0].id, 1u);
  EXPECT_EQ(p.admitted[0].cached_tokens, 5);
  EXPECT_EQ(row_tokens(p, 1), 1);
}

TEST(Scheduler, RemoveFreesBlocksWhereverTheSequenceIs) {
  Harness h({.max_batch_tokens = 4, .max_running = 1}, 16, 4, true);
  h.add(1, 10);
  h.add(2, 10);
  h.step();
  EXPECT_TRUE(h.sched.remove(2));  // waiting
  EXPECT_TRUE(h.sched.remove(1));  // running, mid-prefill
  EXPECT_FALSE(h.sched.remove(1));
  EXPECT_EQ(h.bm.num_available(), 16);
  EXPECT_FALSE(h.sched.has_work());
}

// ---- randomized: the scheduler, the block manager and a fake runner, step by step ----

struct SimRequest {
  std::vector<int> prompt;
  int T = 1, priority = 0, max_new = 1;
  int arrive_step = 0;
  int remove_step = -1;  // ended by its owner at this step (cancel, deadline), when >= 0
};

struct SimConfig {
  SchedulerOptions opts;
  int64_t num_blocks = 64;
  int block_size = 4;
  bool caching = true;
  // Scoring calls between steps: {step, priority, tokens, steps held}.
  struct Score {
    int step, priority, n, hold;
  };
  std::vector<Score> scores;
};

struct SimOutcome {
  std::map<SeqId, std::vector<int>> out;  // generated tokens of the requests that ran to the end
  std::set<SeqId> rejected;               // refused or displaced by a full queue
  int scoring_preempted = 0;              // scoring calls preempted (and started over)
};

// Greedy decoding of `reqs` (ids 1, 2, ...) as the engine runs it; checks, every step, that a row
// writes only into blocks no other sequence holds and that the pool's count of available blocks
// is the number nobody references, and at the end that every block is available again.
SimOutcome simulate(const SimConfig& cfg, const std::vector<SimRequest>& reqs) {
  using testing_fake::FakeRunner;
  FakeRunner runner({.vocab = 64,
                     .block_size = cfg.block_size,
                     .num_blocks = cfg.num_blocks,
                     .max_seq_len = 1 << 20});
  BlockManager bm(cfg.num_blocks, cfg.block_size, cfg.caching);
  Scheduler sched(cfg.opts, &bm);
  SimOutcome res;
  std::set<SeqId> live;
  std::map<SeqId, int> score_release;  // scoring sequence -> step it ends
  std::vector<size_t> score_waits;     // scoring calls waiting for room, first in line first
  std::map<size_t, uint64_t> score_arrival;
  const SeqId kScore = SeqId(1) << 62;
  auto holders = [&] {
    std::vector<SeqId> ids;
    for (const auto& [id, at] : score_release) ids.push_back(id);
    for (SeqId id : live)
      if (bm.has(id)) ids.push_back(id);
    return ids;
  };
  auto check_pool = [&] {
    std::set<int32_t> used;
    for (SeqId id : holders())
      for (int32_t b : bm.table(id)) used.insert(b);
    EXPECT_EQ(bm.num_available(), cfg.num_blocks - int64_t(used.size()));
  };
  auto end = [&](SeqId id) {
    EXPECT_TRUE(sched.remove(id));
    live.erase(id);
  };
  int last_event = 0;
  for (const SimRequest& r : reqs) last_event = std::max(last_event, r.arrive_step);
  for (const SimConfig::Score& sc : cfg.scores) last_event = std::max(last_event, sc.step);
  for (int step = 0; step < 5000; ++step) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      const SeqId id = i + 1;
      if (reqs[i].arrive_step == step) {
        if (sched.add({id, reqs[i].prompt, reqs[i].T, reqs[i].priority}).ok()) {
          live.insert(id);
        } else {
          res.rejected.insert(id);
        }
      }
    }
    sched.accept();  // as the engine: accepted, then cancels and deadlines, then displacement
    for (size_t i = 0; i < reqs.size(); ++i)
      if (reqs[i].remove_step == step && live.count(i + 1)) end(i + 1);
    for (SeqId id : sched.displace()) {
      res.rejected.insert(id);
      end(id);
    }
    // A scoring call ends after its steps (once preempted, it waits for room again: below).
    for (auto it = score_release.begin(); it != score_release.end();) {
      if (it->second <= step) {
        EXPECT_TRUE(sched.scoring(it->first));
        sched.end_scoring(it->first);
        it = score_release.erase(it);
      } else {
        ++it;
      }
    }
    // Scoring calls as the engine serves them: the first in line (highest priority, then oldest)
    // takes room when start_scoring gives it, and blocks are held for it while it waits.
    for (size_t k = 0; k < cfg.scores.size(); ++k)
      if (cfg.scores[k].step == step) {
        score_waits.push_back(k);
        score_arrival[k] = sched.take_arrival();
      }
    auto first_in_line = [&] {
      std::sort(score_waits.begin(), score_waits.end(), [&](size_t a, size_t b) {
        if (cfg.scores[a].priority != cfg.scores[b].priority)
          return cfg.scores[a].priority > cfg.scores[b].priority;
        return score_arrival[a] < score_arrival[b];
      });
    };
    // As the engine, preempted calls queue for room again at once (their owner notices later).
    auto queue_preempted = [&] {
      for (const auto& claim : sched.take_preempted_scoring()) {
        score_release.erase(claim.id);
        score_waits.push_back(size_t(claim.id & ~kScore));
        ++res.scoring_preempted;
      }
      first_in_line();
    };
    first_in_line();
    while (!score_waits.empty()) {
      const size_t k = score_waits.front();
      const SimConfig::Score& sc = cfg.scores[k];
      const SeqId sid = kScore | k;
      if (!sched.start_scoring(sid, sc.n, 1, sc.priority, score_arrival[k])) break;
      score_waits.erase(score_waits.begin());
      std::vector<int> ids(size_t(sc.n), 3);
      std::vector<float> logits;
      const auto& table = bm.table(sid);
      runner.forward(
          Batch{{BatchSeq{ids.data(), sc.n, 0, 1, table.data(), int(table.size()), false, true}}},
          &logits);
      score_release[sid] = step + sc.hold;
      queue_preempted();  // of lower priority, for this one's room
    }
    if (score_waits.empty()) {
      sched.hold_for_scoring(0, 0);
    } else {
      const SimConfig::Score& sc = cfg.scores[score_waits.front()];
      sched.hold_for_scoring(bm.blocks_for(sc.n), sc.priority, score_arrival[score_waits.front()]);
    }
    check_pool();
    if (live.empty() && score_release.empty() && score_waits.empty() && step > last_event) break;
    const StepPlan plan = sched.schedule();
    queue_preempted();
    check_pool();
    // A row writes only into blocks that no other sequence references.
    std::map<int32_t, int> refs;
    for (SeqId id : holders())
      for (int32_t b : bm.table(id)) ++refs[b];
    for (const ScheduledRow& r : plan.rows) {
      const auto& table = bm.table(r.id);
      for (int p = r.pos_begin; p < r.pos_begin + r.n_tokens; p += 1)
        EXPECT_EQ(refs[table[size_t(p / cfg.block_size)]], 1)
            << "step " << step << ": sequence " << r.id << " writes position " << p
            << " into a shared block";
    }
    if (plan.empty()) continue;
    std::vector<float> logits;
    runner.forward(plan.batch, &logits);
    sched.complete(plan);
    size_t row = 0;
    std::vector<SeqId> done;
    for (const ScheduledRow& r : plan.rows) {
      if (!r.sample) continue;
      const float* l = logits.data() + row++ * 64;
      const int tok = int(std::max_element(l, l + 64) - l);
      sched.append(r.id, tok);
      const Sequence* s = sched.find(r.id);
      if (s->generated() == reqs[r.id - 1].max_new) done.push_back(r.id);
    }
    for (SeqId id : done) {
      const Sequence* s = sched.find(id);
      res.out[id].assign(s->tokens.begin() + s->n_prompt, s->tokens.end());
      end(id);
    }
  }
  EXPECT_TRUE(live.empty()) << live.size() << " requests never finished";
  EXPECT_TRUE(score_waits.empty()) << score_waits.size() << " scoring calls never served";
  for (SeqId id : std::set<SeqId>(live)) end(id);
  for (const auto& [sid, at] : score_release) sched.end_scoring(sid);
  EXPECT_EQ(bm.num_available(), cfg.num_blocks);
  EXPECT_FALSE(sched.has_work());
  return res;
}

TEST(Scheduler, RandomWorkloadsKeepBlocksConsistentAndOutputsIdentical) {
  int scoring_preempted = 0;
  for (uint32_t seed = 1; seed <= 300; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    SimConfig cfg;
    cfg.block_size = uni(1, 4);
    cfg.caching = uni(0, 3) != 0;
    cfg.opts.max_batch_tokens = uni(1, 16);
    cfg.opts.max_running = uni(1, 5);
    cfg.opts.max_waiting = uni(1, 8);
    // A few shared prefixes, so that prompts hit each other's blocks.
    std::vector<std::vector<int>> prefixes(3);
    for (auto& p : prefixes)
      for (int i = uni(0, 10); i > 0; --i) p.push_back(uni(0, 63));
    std::vector<SimRequest> reqs(size_t(uni(1, 12)));
    int longest = 0, step = 0;
    for (auto& r : reqs) {
      r.prompt = prefixes[size_t(uni(0, 2))];
      for (int i = uni(r.prompt.empty() ? 1 : 0, 6); i > 0; --i) r.prompt.push_back(uni(0, 63));
      r.T = uni(1, 2);
      r.priority = uni(0, 2);
      r.max_new = uni(1, 10);
      r.arrive_step = step += uni(0, 3);
      if (uni(0, 7) == 0) r.remove_step = r.arrive_step + uni(0, 6);
      longest = std::max(longest, int(r.prompt.size()) + r.max_new);
    }
    // Room for the longest request alone (the engine refuses longer ones), sometimes no more.
    const int64_t need = (longest + cfg.block_size - 1) / cfg.block_size;
    cfg.num_blocks = need + uni(0, 2) * uni(0, int(need));
    for (int i = uni(0, 3); i > 0; --i)
      cfg.scores.push_back(
          {uni(0, step + 5), uni(0, 3), uni(1, int(cfg.num_blocks) * cfg.block_size), uni(1, 4)});
    const SimOutcome got = simulate(cfg, reqs);
    scoring_preempted += got.scoring_preempted;
    for (size_t i = 0; i < reqs.size(); ++i) {
      const SeqId id = i + 1;
      if (got.rejected.count(id) || reqs[i].remove_step >= 0) continue;
      ASSERT_TRUE(got.out.count(id)) << "request " << id << " lost";
      SimRequest alone = reqs[i];
      alone.arrive_step = 0;
      alone.remove_step = -1;
      SimConfig big{.opts = {}, .num_blocks = 4096, .block_size = cfg.block_size, .caching = false};
      EXPECT_EQ(got.out.at(id), simulate(big, {alone}).out.at(1)) << "request " << id;
    }
    if (::testing::Test::HasFailure()) break;
  }
  EXPECT_GT(scoring_preempted, 0) << "no workload preempted a scoring call";
}

}  // namespace
}  // namespace cemlm
