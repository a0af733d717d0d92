// BlockManager: allocation and release, all-or-nothing allocations, reference counts, prefix
// caching keyed exactly by (parent block, tokens, T) whatever the hashes, and LRU eviction of
// unreferenced cached blocks.
#include "cemlm/engine/kv_blocks.h"

#include <gtest/gtest.h>

#include <numeric>

namespace cemlm {
namespace {

std::vector<int> iota_tokens(int n, int first = 0) {
  std::vector<int> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

TEST(BlockManager, AllocatesCoveringBlocksAndFreesThemAll) {
  BlockManager bm(10, 4, true);
  EXPECT_EQ(bm.num_available(), 10);
  ASSERT_TRUE(bm.start(1, {}, 1, 9));  // 9 positions → 3 blocks
  EXPECT_EQ(bm.table(1).size(), 3u);
  EXPECT_DOUBLE_EQ(bm.usage(), 0.3);
  ASSERT_TRUE(bm.grow(1, 12));  // still 3 blocks
  EXPECT_EQ(bm.table(1).size(), 3u);
  ASSERT_TRUE(bm.grow(1, 13));
  EXPECT_EQ(bm.table(1).size(), 4u);
  // Fewer positions than the table covers take nothing (never a negative count).
  EXPECT_EQ(bm.blocks_needed(1, 4), 0);
  EXPECT_EQ(bm.blocks_needed(1, 17), 1);
  bm.release(1);
  EXPECT_FALSE(bm.has(1));
  EXPECT_EQ(bm.num_available(), 10);
  EXPECT_DOUBLE_EQ(bm.usage(), 0.0);
}

TEST(BlockManager, FailedAllocationLeavesStateUntouched) {
  BlockManager bm(4, 4, true);
  ASSERT_TRUE(bm.start(1, {}, 1, 12));  // 3 blocks
  const auto table = bm.table(1);
  EXPECT_FALSE(bm.start(2, {}, 1, 8));  // needs 2, 1 left
  EXPECT_FALSE(bm.has(2));
  EXPECT_EQ(bm.num_available(), 1);
  EXPECT_FALSE(bm.grow(1, 20));  // needs 2 more
  EXPECT_EQ(bm.table(1), table);
  EXPECT_EQ(bm.num_available(), 1);
  EXPECT_EQ(bm.blocks_needed(1, 20), 2);
}

TEST(BlockManager, PrefixHitsFullBlocksOnlyAndNeverTheLastToken) {
  BlockManager bm(16, 4, true);
  const auto tokens = iota_tokens(10);
  ASSERT_TRUE(bm.start(1, {}, 2, 10));
  bm.mark_computed(1, tokens, 10);  // publishes blocks [0,4) and [4,8)
  const auto first_two = std::vector<int32_t>(bm.table(1).begin(), bm.table(1).begin() + 2);
  bm.release(1);

  PrefixMatch m = bm.match_prefix(tokens, 2);
  EXPECT_EQ(m.blocks, first_two);
  // 8 tokens: the second block holds the last token, which must be computed again.
  EXPECT_EQ(bm.match_prefix(iota_tokens(8), 2).blocks.size(), 1u);
  // A different token in the second block: only the first block matches.
  auto other = tokens;
  other[5] = 99;
  EXPECT_EQ(bm.match_prefix(other, 2).blocks.size(), 1u);
  // The same tokens computed with another T never hit.
  EXPECT_TRUE(bm.match_prefix(tokens, 1).blocks.empty());
  EXPECT_TRUE(bm.match_prefix(tokens, 3).blocks.empty());
  // A different first block breaks the chain even when later blocks are equal.
  other = tokens;
  other[0] = 99;
  EXPECT_TRUE(bm.match_prefix(other, 2).blocks.empty());
}

TEST(BlockManager, SharedBlocksAreReferenceCounted) {
  BlockManager bm(8, 4, true);
  const auto tokens = iota_tokens(9);
  ASSERT_TRUE(bm.start(1, {}, 1, 9));
  bm.mark_computed(1, tokens, 9);
  const PrefixMatch m = bm.match_prefix(tokens, 1);
  ASSERT_EQ(m.blocks.size(), 2u);
  ASSERT_TRUE(bm.start(2, m, 1, 9));  // shares 2 blocks, adds 1
  EXPECT_EQ(bm.table(2)[0], bm.table(1)[0]);
  EXPECT_EQ(bm.table(2)[1], bm.table(1)[1]);
  EXPECT_NE(bm.table(2)[2], bm.table(1)[2]);
  EXPECT_EQ(bm.num_available(), 4);
  bm.release(1);
  EXPECT_EQ(bm.num_available(), 5);  // shared blocks still held by seq 2
  bm.release(2);
  EXPECT_EQ(bm.num_available(), 8);
}

TEST(BlockManager, IdleHitsCountAgainstTheRoomLeft) {
  BlockManager bm(3, 4, true);
  const auto tokens = iota_tokens(9);
  ASSERT_TRUE(bm.start(1, {}, 1, 9));
  bm.mark_computed(1, tokens, 9);
  bm.release(1);  // 2 idle cached blocks + 1 free
  const PrefixMatch m = bm.match_prefix(tokens, 1);
  ASSERT_EQ(m.blocks.size(), 2u);
  // Reusing the 2 idle blocks leaves 1 block: 13 positions (4 blocks) cannot fit.
  EXPECT_FALSE(bm.start(2, m, 1, 13));
  EXPECT_EQ(bm.num_available(), 3);
  EXPECT_EQ(bm.match_prefix(tokens, 1).blocks.size(), 2u);  // nothing evicted by the failure
  ASSERT_TRUE(bm.start(2, m, 1, 12));
  EXPECT_EQ(bm.num_available(), 0);
}

// start_cost: the fresh blocks plus the idle hits, now or once some sequences are released.
TEST(BlockManager, StartCostCountsIdleHitsNowAndAfterReleases) {
  BlockManager bm(10, 4, true);
  const auto tokens = iota_tokens(9);
  ASSERT_TRUE(bm.start(1, {}, 1, 9));
  bm.mark_computed(1, tokens, 9);
  const PrefixMatch m = bm.match_prefix(tokens, 1);
  ASSERT_EQ(m.blocks.size(), 2u);
  ASSERT_TRUE(bm.start(2, m, 1, 9));  // holds the two hits too
  EXPECT_EQ(bm.start_cost(m, 13), 2);  // 4 blocks: the 2 hits are held, 2 fresh
  EXPECT_EQ(bm.start_cost(m, 13, std::vector<SeqId>{1}), 2);  // 2 still holds them
  EXPECT_EQ(bm.start_cost(m, 13, std::vector<SeqId>{1, 2}), 4);  // both idle then
  EXPECT_EQ(bm.start_cost({}, 13), 4);
  EXPECT_EQ(bm.reclaimable(std::vector<SeqId>{1, 2}), 10);
  // Releasing 1 alone frees its third block only: 2 still holds the two it shares.
  EXPECT_EQ(bm.reclaimable(std::vector<SeqId>{1}), bm.num_available() + 1);
  bm.release(1);
  bm.release(2);
  EXPECT_EQ(bm.start_cost(m, 13), 4);  // as predicted
}

TEST(BlockManager, EvictsLeastRecentlyUsedTailBlocksFirst) {
  BlockManager bm(4, 2, true);
  const auto a = iota_tokens(5, 0), b = iota_tokens(5, 100);
  ASSERT_TRUE(bm.start(1, {}, 1, 4));
  bm.mark_computed(1, a, 4);
  bm.release(1);  // a's 2 blocks cached, idle
  ASSERT_TRUE(bm.start(2, {}, 1, 4));  // takes the 2 free blocks
  bm.mark_computed(2, b, 4);
  bm.release(2);  // b's blocks are now the most recently used
  // One new block: evicts a's TAIL block, so a's first block still hits.
  ASSERT_TRUE(bm.start(3, {}, 1, 2));
  EXPECT_EQ(bm.match_prefix(a, 1).blocks.size(), 1u);
  EXPECT_EQ(bm.match_prefix(b, 1).blocks.size(), 2u);
  ASSERT_TRUE(bm.grow(3, 6));  // two more: a's head, then b's tail
  EXPECT_TRUE(bm.match_prefix(a, 1).blocks.empty());
  EXPECT_EQ(bm.match_prefix(b, 1).blocks.size(), 1u);
  bm.release(3);
  EXPECT_EQ(bm.num_available(), 4);
}

TEST(BlockManager, SameContentPublishedTwiceKeepsOneEntry) {
  BlockManager bm(8, 2, true);
  const auto t = iota_tokens(3);
  ASSERT_TRUE(bm.start(1, {}, 1, 3));
  ASSERT_TRUE(bm.start(2, {}, 1, 3));
  bm.mark_computed(1, t, 3);
  bm.mark_computed(2, t, 3);
  EXPECT_EQ(bm.match_prefix(t, 1).blocks[0], bm.table(1)[0]);
  bm.release(1);
  bm.release(2);
  EXPECT_EQ(bm.num_available(), 8);
  EXPECT_EQ(bm.match_prefix(t, 1).blocks.size(), 1u);
}

// Two sequences computed the same blocks at once: the second's copy stays private, and what it
// publishes after them continues the first's chain, so a later prompt hits all of it.
TEST(BlockManager, BlocksPublishedAfterADuplicateContinueTheFirstPublishersChain) {
  BlockManager bm(8, 2, true);
  const auto t = iota_tokens(5);
  ASSERT_TRUE(bm.start(1, {}, 1, 3));
  ASSERT_TRUE(bm.start(2, {}, 1, 5));
  bm.mark_computed(1, t, 3);  // publishes [0, 1]
  bm.mark_computed(2, t, 5);  // its [0, 1] is a duplicate; publishes [2, 3] after 1's
  const PrefixMatch m = bm.match_prefix(t, 1);
  ASSERT_EQ(m.blocks.size(), 2u);
  EXPECT_EQ(m.blocks[0], bm.table(1)[0]);
  EXPECT_EQ(m.blocks[1], bm.table(2)[1]);
}

// A sequence that computed a block another published first moves onto the published one and
// frees its copy: the content stays matchable while the sequence holds it. (Its copy stayed
// private; once the publisher ended, its idle blocks were evicted, and the later block the second
// sequence published hung under a parent nobody could match: no hits for its tokens at all.)
TEST(BlockManager, ASequenceMovesOntoTheBlockPublishedFirstWithItsContent) {
  BlockManager bm(8, 2, true);
  const std::vector<int> t = {1, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE(bm.start(1, {}, 1, 4));  // A: blocks 0, 1
  ASSERT_TRUE(bm.start(2, {}, 1, 4));  // B, the same prompt in the same step: 2, 3
  bm.mark_computed(1, t, 4);           // A publishes [1, 2] [3, 4]
  bm.mark_computed(2, t, 4);           // B moves onto them
  EXPECT_EQ(bm.table(2), bm.table(1));
  EXPECT_EQ(bm.num_available(), 6);  // B's copies are free again
  ASSERT_TRUE(bm.grow(2, 6));
  bm.mark_computed(2, t, 6);  // B publishes [5, 6]
  bm.release(1);              // A ends: B still holds its blocks
  ASSERT_TRUE(bm.start(3, {}, 1, 2 * int(bm.num_available())));  // takes every available block
  bm.release(3);
  EXPECT_EQ(bm.match_prefix(t, 1).blocks, bm.table(2));
  bm.release(2);
  EXPECT_EQ(bm.num_available(), 8);
}

// A block computed with another T is not the same content: a sequence keeps its own.
TEST(BlockManager, ABlockOfAnotherRecursionIsNotMovedOnto) {
  BlockManager bm(8, 2, true);
  const std::vector<int> t = {1, 2, 3};
  ASSERT_TRUE(bm.start(1, {}, 1, 2));
  ASSERT_TRUE(bm.start(2, {}, 2, 2));
  bm.mark_computed(1, t, 2);
  bm.mark_computed(2, t, 2);
  EXPECT_NE(bm.table(2), bm.table(1));
  EXPECT_EQ(bm.match_prefix(t, 1).blocks, bm.table(1));
  EXPECT_EQ(bm.match_prefix(t, 2).blocks, bm.table(2));
}

// An evicted block that goes back unpublished is free again, not cached: it is taken before any
// cached block is evicted.
TEST(BlockManager, AnEvictedBlockReleasedUnpublishedIsTakenBeforeCachedOnes) {
  BlockManager bm(2, 2, true);
  const auto t = iota_tokens(5);
  ASSERT_TRUE(bm.start(1, {}, 1, 4));
  bm.mark_computed(1, t, 4);  // both blocks cached
  bm.release(1);              // the tail block first in line for eviction
  ASSERT_TRUE(bm.start(2, {}, 1, 2));  // evicts the tail block
  bm.release(2);                       // nothing published in it
  ASSERT_TRUE(bm.start(3, {}, 1, 2));  // takes it again, not the cached head
  EXPECT_EQ(bm.match_prefix(t, 1).blocks.size(), 1u);
  bm.release(3);
  EXPECT_EQ(bm.num_available(), 2);
}

// Every key hashes alike here, as a crafted collision would: a block is found by its exact key,
// so the attacker's second block (computed after a different first block) never serves a prompt
// whose first block is the victim's, while each chain still finds itself.
TEST(BlockManager, CollidingKeysNeverHit) {
  BlockManager bm(16, 2, true, [](uint64_t, std::span<const int>, int) -> uint64_t { return 7; });
  const std::vector<int> victim = {1, 2, 7, 7, 0}, attacker = {9, 9, 3, 4, 0};
  for (auto [seq, tokens] : {std::pair{1, victim}, std::pair{2, attacker}}) {
    ASSERT_TRUE(bm.start(SeqId(seq), {}, 1, 5));
    bm.mark_computed(SeqId(seq), tokens, 5);
    bm.release(SeqId(seq));
  }
  EXPECT_EQ(bm.match_prefix(std::vector<int>{1, 2, 3, 4, 0}, 1).blocks.size(), 1u);
  EXPECT_EQ(bm.match_prefix(victim, 1).blocks.size(), 2u);
  EXPECT_EQ(bm.match_prefix(attacker, 1).blocks.size(), 2u);
  EXPECT_TRUE(bm.match_prefix(std::vector<int>{9, 9, 7, 7, 0}, 1).blocks.size() == 1u);
  EXPECT_TRUE(bm.match_prefix(victim, 2).blocks.empty());  // T is part of the key
  EXPECT_EQ(bm.num_available(), 16);
}

// A salt is part of a first block's key, and so of every block after it: sequences of different
// salts share nothing, with the default hash or one where every key collides, and a sequence
// publishing content another salt holds keeps its own copy.
TEST(BlockManager, SaltsShareOnlyWithTheirOwnSalt) {
  for (BlockManager::KeyHash hash :
       {BlockManager::KeyHash(nullptr),
        BlockManager::KeyHash([](uint64_t, std::span<const int>, int) -> uint64_t { return 7; })}) {
    BlockManager bm(16, 2, true, hash);
    const auto t = iota_tokens(5);
    ASSERT_TRUE(bm.start(1, {}, 1, 5, "alice"));
    ASSERT_TRUE(bm.start(2, {}, 1, 5, "bob"));
    bm.mark_computed(1, t, 5);
    bm.mark_computed(2, t, 5);
    EXPECT_NE(bm.table(1)[0], bm.table(2)[0]);  // not moved onto alice's block
    const std::vector<int32_t> alices(bm.table(1).begin(), bm.table(1).begin() + 2);
    const std::vector<int32_t> bobs(bm.table(2).begin(), bm.table(2).begin() + 2);
    bm.release(1);
    bm.release(2);
    EXPECT_EQ(bm.match_prefix(t, 1, "alice").blocks, alices);
    EXPECT_EQ(bm.match_prefix(t, 1, "bob").blocks, bobs);
    EXPECT_TRUE(bm.match_prefix(t, 1).blocks.empty());          // no salt
    EXPECT_TRUE(bm.match_prefix(t, 1, "alic").blocks.empty());  // a prefix of one
    EXPECT_TRUE(bm.match_prefix(t, 1, std::string_view("alice\0", 6)).blocks.empty());
    EXPECT_TRUE(bm.match_prefix(t, 2, "alice").blocks.empty());  // T still counts
    // Unsalted sequences share among themselves as before.
    ASSERT_TRUE(bm.start(3, {}, 1, 5));
    bm.mark_computed(3, t, 5);
    bm.release(3);
    EXPECT_EQ(bm.match_prefix(t, 1).blocks.size(), 2u);
    EXPECT_EQ(bm.num_available(), 16);
  }
}

TEST(BlockManager, PrefixCachingOffNeverMatches) {
  BlockManager bm(8, 2, false);
  const auto t = iota_tokens(5);
  ASSERT_TRUE(bm.start(1, {}, 1, 5));
  bm.mark_computed(1, t, 5);
  bm.release(1);
  EXPECT_TRUE(bm.match_prefix(t, 1).blocks.empty());
  EXPECT_EQ(bm.num_available(), 8);
}

}  // namespace
}  // namespace cemlm
