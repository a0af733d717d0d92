// A deterministic stand-in for the model runner, for the engine's host-side tests. Each cached
// position holds a hash chained over the PREVIOUS position's entry (read back through the block
// table), the token, the position and T; logits are a fixed function of that hash. So outputs
// depend on every earlier token and on T only through the paged cache: a wrong block table, a
// foreign or stale prefix-cache block, or a lost entry changes them.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "cemlm/engine/model_runner.h"
#include "cemlm/kernels/tensor.h"

namespace cemlm::testing_fake {

struct FakeOptions {
  int vocab = 64;
  int block_size = 4;
  int64_t num_blocks = 256;
  int max_seq_len = 256;
  int eos_id = -1;
  // When set, the logits computed at position p get +10 on favorite(p) (if >= 0): a script.
  std::function<int(int pos)> favorite;
  // When set and true for p, the logits computed at position p hold a NaN (a broken checkpoint).
  std::function<bool(int pos)> nan_at;
  // When set and M = spread(p) > 0, the logits computed at position p are +M on token 0 and −M on
  // every other: finite, but with M = FLT_MAX the others' log-probabilities (−2M) pass a float's
  // range, and with M = 1000 a text of tokens other than 0 has a perplexity past a double's.
  std::function<float(int pos)> spread;
  // When set and true for a position p a forward feeds, that forward throws std::bad_alloc once
  // it has written the cache (as when a batch's logits find no memory).
  std::function<bool(int pos)> throw_at;
};

class FakeRunner final : public ModelRunner {
 public:
  explicit FakeRunner(FakeOptions o) : o_(std::move(o)) {
    cfg_.vocab_size = o_.vocab;
    cfg_.d_model = 8;
    cfg_.n_layers = 3;
    cfg_.n_heads = 1;
    cfg_.head_dim = 8;
    cfg_.d_ff = 8;
    cfg_.max_seq_len = o_.max_seq_len;
    cfg_.attention = AttentionType::kCem;
    cfg_.mlp = MlpType::kCem;
    cfg_.recursion_default = 1;
    cfg_.recursion_max = 8;
    cfg_.eos_id = o_.eos_id;
    slots_.assign(size_t(o_.num_blocks * o_.block_size), 0);
    written_.assign(slots_.size(), false);
  }

  const ModelConfig& config() const override { return cfg_; }
  int block_size() const override { return o_.block_size; }
  int64_t num_blocks() const override { return o_.num_blocks; }
  void copy_block(int32_t, int32_t) override { CEMLM_CHECK(false && "not used by the engine"); }

  void forward(const Batch& batch, std::vector<float>* logits) override {
    logits->clear();
    ++steps_;
    const bool scoring = std::any_of(batch.seqs.begin(), batch.seqs.end(),
                                     [](const BatchSeq& s) { return s.want_all_logits; });
    forwards_.push_back(scoring ? 'S' : 'G');
    if (std::find(buffers_.begin(), buffers_.end(), logits) == buffers_.end())
      buffers_.push_back(logits);
    bool fail = false;
    for (size_t i = 0; i < batch.seqs.size(); ++i) {
      const BatchSeq& s = batch.seqs[i];
      // The contract: rows ordered by recursion descending, tables covering the fed positions.
      CEMLM_CHECK(i == 0 || batch.seqs[i - 1].recursion >= s.recursion);
      CEMLM_CHECK(int64_t(s.n_blocks) * o_.block_size >= s.pos_begin + s.n_tokens);
      max_rows_ = std::max(max_rows_, int(batch.seqs.size()));
      for (int j = 0; j < s.n_tokens; ++j) {
        const int p = s.pos_begin + j;
        const uint64_t prev = p == 0 ? 0x1234567ULL : read(s, p - 1);
        const uint64_t h = mix(mix(prev ^ uint64_t(s.tokens[j])) ^ (uint64_t(p) << 20) ^
                               (uint64_t(s.recursion) << 40));
        write(s, p, h);
        fail = fail || (o_.throw_at && o_.throw_at(p));
        ++tokens_processed_;
        if (s.want_all_logits || (s.want_logits && j == s.n_tokens - 1)) emit(h, p, logits);
      }
    }
    if (fail) throw std::bad_alloc();
  }

  int64_t tokens_processed() const { return tokens_processed_; }
  int64_t steps() const { return steps_; }
  int max_rows() const { return max_rows_; }
  // One letter per forward, in order: 'S' scoring (every position's logits), 'G' generation.
  // Read once the engine has stopped.
  const std::string& forwards() const { return forwards_; }
  // The distinct logits buffers forwards wrote into. Read once the engine has stopped.
  size_t logits_buffers() const { return buffers_.size(); }

 private:
  static uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  size_t slot(const BatchSeq& s, int p) const {
    CEMLM_CHECK(p / o_.block_size < s.n_blocks);
    const int32_t b = s.block_table[p / o_.block_size];
    CEMLM_CHECK(b >= 0 && b < o_.num_blocks);
    return size_t(b) * size_t(o_.block_size) + size_t(p % o_.block_size);
  }
  uint64_t read(const BatchSeq& s, int p) const {
    const size_t k = slot(s, p);
    CEMLM_CHECK(written_[k]);
    return slots_[k];
  }
  void write(const BatchSeq& s, int p, uint64_t h) {
    const size_t k = slot(s, p);
    slots_[k] = h;
    written_[k] = true;
  }
  void emit(uint64_t h, int p, std::vector<float>* logits) const {
    const int fav = o_.favorite ? o_.favorite(p) : -1;
    for (int v = 0; v < o_.vocab; ++v) {
      const double u = double(mix(h ^ (uint64_t(v) * 0xD1B54A32D192ED03ULL)) >> 11) / 9007199254740992.0;
      logits->push_back(float(6.0 * u - 3.0) + (v == fav ? 10.0f : 0.0f));
    }
    if (o_.nan_at && o_.nan_at(p)) logits->back() = std::numeric_limits<float>::quiet_NaN();
    if (const float m = o_.spread ? o_.spread(p) : 0.0f; m > 0) {
      float* row = logits->data() + logits->size() - size_t(o_.vocab);
      std::fill(row, row + o_.vocab, -m);
      row[0] = m;
    }
  }

  FakeOptions o_;
  ModelConfig cfg_;
  std::vector<uint64_t> slots_;
  std::vector<bool> written_;
  std::string forwards_;
  std::vector<const std::vector<float>*> buffers_;
  int64_t tokens_processed_ = 0, steps_ = 0;
  int max_rows_ = 0;
};

}  // namespace cemlm::testing_fake
