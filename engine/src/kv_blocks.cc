// BlockManager (see kv_blocks.h). Every mutating call plans first (counts what it needs against
// what is available) and only then commits, so a failed allocation leaves the state untouched.
#include "cemlm/engine/kv_blocks.h"

#include <algorithm>

#include "cemlm/kernels/tensor.h"

namespace cemlm {
namespace {

uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// What a first block's key hash takes for the block before it: 0 for no salt (as before salts).
uint64_t salt_hash(std::string_view salt) {
  uint64_t h = 0;
  for (unsigned char c : salt) h = mix(h ^ (uint64_t(c) + 0x2545F4914F6CDD1DULL));
  return h;
}

uint64_t default_hash(uint64_t parent, std::span<const int> tokens, int T) {
  uint64_t h = mix(parent + 0x9E3779B97F4A7C15ULL * uint64_t(T + 1));
  for (int t : tokens) h = mix(h ^ (uint64_t(uint32_t(t)) + 0x632BE59BD9B4E019ULL));
  return h;
}

}  // namespace

BlockManager::BlockManager(int64_t num_blocks, int block_size, bool prefix_caching, KeyHash hash)
    : block_size_(block_size),
      prefix_caching_(prefix_caching),
      hash_(hash ? hash : default_hash),
      blocks_(size_t(num_blocks)) {
  CEMLM_CHECK(num_blocks > 0 && block_size > 0);
  free_.reserve(size_t(num_blocks));
  // Lowest ids on top of the stack: allocation order is easy to follow in tests and logs.
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(int32_t(b));
}

double BlockManager::usage() const {
  return double(num_blocks() - num_available()) / double(num_blocks());
}

int32_t BlockManager::find_cached(uint64_t parent, std::string_view salt,
                                  std::span<const int> tokens, int T) const {
  auto [it, end] = index_.equal_range(hash_(parent ? parent : salt_hash(salt), tokens, T));
  for (; it != end; ++it) {
    const Block& b = blocks_[size_t(it->second)];
    // A later block's salt is its first block's, which its parent instance names.
    if (b.parent == parent && b.recursion == T && (parent || b.salt == salt) &&
        std::equal(tokens.begin(), tokens.end(), b.tokens.begin(), b.tokens.end()))
      return it->second;
  }
  return -1;
}

PrefixMatch BlockManager::match_prefix(std::span<const int> tokens, int T,
                                       std::string_view salt) const {
  PrefixMatch m;
  if (!prefix_caching_ || tokens.empty()) return m;
  const size_t max_blocks = (tokens.size() - 1) / size_t(block_size_);
  uint64_t parent = 0;
  for (size_t i = 0; i < max_blocks; ++i) {
    const int32_t b =
        find_cached(parent, salt, tokens.subspan(i * size_t(block_size_), size_t(block_size_)), T);
    if (b < 0) break;
    m.blocks.push_back(b);
    parent = blocks_[size_t(b)].instance;
  }
  return m;
}

bool BlockManager::start(SeqId seq, const PrefixMatch& match, int T, int n_positions,
                         std::string_view salt) {
  CEMLM_CHECK(!has(seq));
  const int64_t total = blocks_for(n_positions);
  if (start_cost(match, n_positions) > num_available()) return false;

  SeqBlocks& s = seqs_[seq];
  s.recursion = T;
  s.salt = salt;
  for (int32_t b : match.blocks) {
    add_ref(b);
    s.table.push_back(b);
    s.chain.push_back(blocks_[size_t(b)].instance);
  }
  while (int64_t(s.table.size()) < total) s.table.push_back(take_block());
  return true;
}

int64_t BlockManager::blocks_needed(SeqId seq, int n_positions) const {
  return std::max<int64_t>(0, blocks_for(n_positions) - int64_t(table(seq).size()));
}

bool BlockManager::grow(SeqId seq, int n_positions) {
  const int64_t need = blocks_needed(seq, n_positions);
  if (need > num_available()) return false;
  auto& table = seqs_.at(seq).table;
  for (int64_t i = 0; i < need; ++i) table.push_back(take_block());
  return true;
}

void BlockManager::mark_computed(SeqId seq, std::span<const int> tokens, int n_computed) {
  if (!prefix_caching_) return;
  SeqBlocks& s = seqs_.at(seq);
  const size_t bs = size_t(block_size_);
  for (size_t i = s.chain.size(); (i + 1) * bs <= size_t(n_computed) && i < s.table.size(); ++i) {
    const uint64_t parent = i ? s.chain[i - 1] : 0;
    auto chunk = tokens.subspan(i * bs, bs);
    // Another sequence may have published the same content first (equal keys, equal contents):
    // the sequence moves onto that block and frees its copy. (Kept private, the copy held the
    // content while the published block went idle and could be evicted: a request with this
    // sequence's tokens then found nothing cached, though all of it was.) The block is full and
    // computed, so nothing writes into it again.
    if (const int32_t same = find_cached(parent, s.salt, chunk, s.recursion); same >= 0) {
      add_ref(same);
      drop_ref(s.table[i]);
      s.table[i] = same;
      s.chain.push_back(blocks_[size_t(same)].instance);
      continue;
    }
    const int32_t id = s.table[i];
    Block& b = blocks_[size_t(id)];
    b.cached = true;
    b.instance = next_instance_++;
    b.parent = parent;
    b.recursion = s.recursion;
    b.tokens.assign(chunk.begin(), chunk.end());
    b.salt = parent ? std::string() : s.salt;
    b.hash = hash_(parent ? parent : salt_hash(s.salt), chunk, s.recursion);
    index_.emplace(b.hash, id);
    s.chain.push_back(b.instance);
  }
}

void BlockManager::release(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return;
  // Tail blocks first, so they are evicted before the prefix blocks their chain depends on.
  for (auto b = it->second.table.rbegin(); b != it->second.table.rend(); ++b) drop_ref(*b);
  seqs_.erase(it);
}

std::unordered_map<int32_t, int> BlockManager::held_by(std::span<const SeqId> seqs) const {
  std::unordered_map<int32_t, int> held;
  for (SeqId s : seqs)
    for (int32_t b : table(s)) ++held[b];
  return held;
}

int64_t BlockManager::reclaimable(std::span<const SeqId> seqs) const {
  int64_t n = num_available();
  for (const auto& [b, refs] : held_by(seqs)) n += refs == blocks_[size_t(b)].ref;
  return n;
}

int64_t BlockManager::start_cost(const PrefixMatch& match, int n_positions,
                                 std::span<const SeqId> released) const {
  const int64_t total = blocks_for(n_positions);
  CEMLM_CHECK(total >= int64_t(match.blocks.size()));
  const auto held = held_by(released);
  int64_t idle_hits = 0;  // taking a hit from the LRU pool shrinks what is available
  for (int32_t b : match.blocks) {
    const auto it = held.find(b);
    idle_hits += blocks_[size_t(b)].ref == (it == held.end() ? 0 : it->second);
  }
  return total - int64_t(match.blocks.size()) + idle_hits;
}

const std::vector<int32_t>& BlockManager::table(SeqId seq) const { return seqs_.at(seq).table; }

int32_t BlockManager::take_block() {
  int32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    CEMLM_CHECK(!lru_.empty());
    id = lru_.front();
    lru_.pop_front();
    Block& b = blocks_[size_t(id)];
    for (auto [it, end] = index_.equal_range(b.hash); it != end; ++it)
      if (it->second == id) {
        index_.erase(it);
        break;
      }
    b.cached = false;
    b.tokens.clear();
    b.salt.clear();
  }
  blocks_[size_t(id)].ref = 1;
  return id;
}

void BlockManager::add_ref(int32_t id) {
  Block& b = blocks_[size_t(id)];
  if (b.ref++ == 0) lru_.erase(b.lru_pos);
}

void BlockManager::drop_ref(int32_t id) {
  Block& b = blocks_[size_t(id)];
  CEMLM_CHECK(b.ref > 0);
  if (--b.ref > 0) return;
  if (b.cached) {
    b.lru_pos = lru_.insert(lru_.end(), id);
  } else {
    free_.push_back(id);
  }
}

}  // namespace cemlm
