// Host-side bookkeeping of the paged KV cache: fixed-size blocks, a free list, per-sequence block
// tables, reference counts and a prefix cache of FULL blocks. A cached block is known by its exact
// key: (the cached block before it, as an instance that eviction retires, the block's token ids,
// T; for a sequence's first block, the sequence's cache salt in place of a block before it). A
// hash of the key only finds candidates; equal hashes never make a hit, so a crafted collision
// cannot serve one client's cache to another, and sequences of different salts share nothing. Only
// full, already-computed blocks are ever shared and nobody writes into a shared block, so no
// copy-on-write is needed.
#pragma once
#include <cstdint>
#include <list>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace cemlm {

using SeqId = uint64_t;

// The cached full blocks that start a token sequence (see BlockManager::match_prefix).
struct PrefixMatch {
  std::vector<int32_t> blocks;
};

class BlockManager {
 public:
  // The hash of a cached block's key: only where to look (a test passes a colliding one). `parent`
  // is the instance of the block before it, or for a first block a hash of the salt (0: none).
  using KeyHash = uint64_t (*)(uint64_t parent, std::span<const int> tokens, int T);
  BlockManager(int64_t num_blocks, int block_size, bool prefix_caching, KeyHash hash = nullptr);

  int block_size() const { return block_size_; }
  int64_t num_blocks() const { return int64_t(blocks_.size()); }
  // Blocks an allocation may take now: free ones plus unreferenced cached ones (evicted LRU first).
  int64_t num_available() const { return int64_t(free_.size() + lru_.size()); }
  // Fraction of blocks referenced by some sequence (the kv_cache_usage metric).
  double usage() const;
  int64_t blocks_for(int64_t n_positions) const {
    return (n_positions + block_size_ - 1) / block_size_;
  }

  // The longest run of cached full blocks that begins `tokens` at recursion T, published by
  // sequences of the same `salt`. It never covers the last token, so a sequence always computes
  // at least one token (whose logits it needs).
  PrefixMatch match_prefix(std::span<const int> tokens, int T, std::string_view salt = {}) const;
  // Starts `seq` on the blocks of `match` (as returned by match_prefix, with the same salt and no
  // state change in between) plus fresh blocks covering positions [0, n_positions); the blocks it
  // publishes are found by sequences of its salt only. False, with nothing changed, when the fresh
  // blocks do not fit.
  bool start(SeqId seq, const PrefixMatch& match, int T, int n_positions,
             std::string_view salt = {});
  // Extends `seq`'s table to cover positions [0, n_positions). False, nothing changed, if no room.
  bool grow(SeqId seq, int n_positions);
  // Blocks `grow(seq, n_positions)` would take from the pool.
  int64_t blocks_needed(SeqId seq, int n_positions) const;
  // Publishes the full blocks among `seq`'s first `n_computed` tokens in the prefix cache.
  void mark_computed(SeqId seq, std::span<const int> tokens, int n_computed);
  // Drops `seq`'s references; its cached blocks stay reusable until evicted.
  void release(SeqId seq);
  // Blocks available once every sequence of `seqs` is released: those available now plus those
  // nobody else references.
  int64_t reclaimable(std::span<const SeqId> seqs) const;
  // The available blocks that start(·, match, ·, n_positions) takes: the fresh ones plus the hits
  // nobody references (they sit in the LRU pool); as it will be once `released` are released.
  int64_t start_cost(const PrefixMatch& match, int n_positions,
                     std::span<const SeqId> released = {}) const;

  bool has(SeqId seq) const { return seqs_.count(seq) != 0; }
  const std::vector<int32_t>& table(SeqId seq) const;

 private:
  struct Block {
    int ref = 0;
    bool cached = false;  // in index_ (the key below is valid)
    // The key: which published block instance precedes this one (0: none, the sequence's start,
    // and then its salt), the tokens and T. `instance` names this publication; it is never
    // reused, so a block that was evicted and published again is a different parent for whatever
    // follows.
    uint64_t instance = 0, parent = 0, hash = 0;
    int recursion = 0;
    std::vector<int> tokens;
    std::string salt;                      // a first block's (parent 0)
    std::list<int32_t>::iterator lru_pos;  // valid while cached and unreferenced
  };
  struct SeqBlocks {
    std::vector<int32_t> table;
    // For the leading full blocks whose content is cached (by this sequence or another): the
    // instance that holds that content, the parent of the next block.
    std::vector<uint64_t> chain;
    int recursion = 1;
    std::string salt;
  };

  // The cached block of this key (for a first block, parent 0, the salt is part of it); -1: none.
  int32_t find_cached(uint64_t parent, std::string_view salt, std::span<const int> tokens,
                      int T) const;
  // Block -> how many of its references the sequences of `seqs` hold.
  std::unordered_map<int32_t, int> held_by(std::span<const SeqId> seqs) const;
  int32_t take_block();  // caller checked num_available() > 0
  void add_ref(int32_t b);
  void drop_ref(int32_t b);

  int block_size_;
  bool prefix_caching_;
  KeyHash hash_;
  uint64_t next_instance_ = 1;
  std::vector<Block> blocks_;
  std::vector<int32_t> free_;
  std::list<int32_t> lru_;  // unreferenced cached blocks, least recently used first
  std::unordered_multimap<uint64_t, int32_t> index_;  // key hash -> cached blocks
  std::unordered_map<SeqId, SeqBlocks> seqs_;
};

}  // namespace cemlm
