// Whole-model properties of the CPU forward (MODEL.md §3–§9): causality, the effect of T, and
// that paged, chunked, batched execution with mixed T equals the full-sequence forward.
#include <gtest/gtest.h>
#include <omp.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

#include "cemlm/engine/cpu_model.h"
#include "tiny_models.h"

namespace cemlm {
namespace {

using testing_models::all_variants;
using testing_models::make_config;
using testing_models::randomize;
using testing_models::Variant;

std::vector<int> random_ids(int n, int vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int> ids(n);
  for (int& t : ids) t = int(rng.next_u64() % uint64_t(vocab));
  return ids;
}

// max |a − b| / max(1, max |b|)
double rel_err(const float* a, const float* b, size_t n) {
  double diff = 0, mag = 1;
  for (size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - b[i]));
    mag = std::max(mag, std::fabs(double(b[i])));
  }
  return diff / mag;
}

class ModelTest : public ::testing::TestWithParam<testing_models::Variant> {
 protected:
  void SetUp() override {
    cfg_ = make_config(GetParam());
    store_ = ParamStore(cfg_);
    randomize(store_, 7);
    w_ = bind_weights(cfg_, store_);
  }
  ModelConfig cfg_;
  ParamStore store_;
  Weights w_;
};

TEST_P(ModelTest, CausalAtEveryDepth) {
  const int N = 12, j = 7, V = cfg_.vocab_size;
  for (int T : {1, 2, 4}) {
    auto ids = random_ids(N, V, 3);
    auto base = full_forward(cfg_, w_, ids, T);
    ids[j] = (ids[j] + 5) % V;
    auto changed = full_forward(cfg_, w_, ids, T);
    for (int i = 0; i < j; ++i)
      for (int v = 0; v < V; ++v)
        ASSERT_EQ(base[size_t(i) * V + v], changed[size_t(i) * V + v]) << "T=" << T << " i=" << i;
    double later = 0;
    for (size_t k = size_t(j) * V; k < base.size(); ++k) later += std::fabs(base[k] - changed[k]);
    EXPECT_GT(later, 0.0) << "changing token " << j << " changed nothing after it";
  }
}

TEST_P(ModelTest, RecursionDepthMattersOnlyForCem) {
  auto ids = random_ids(10, cfg_.vocab_size, 5);
  auto t1 = full_forward(cfg_, w_, ids, 1);
  auto t3 = full_forward(cfg_, w_, ids, 3);
  const bool cem = cfg_.attention == AttentionType::kCem || cfg_.mlp == MlpType::kCem;
  const double e = rel_err(t1.data(), t3.data(), t1.size());
  if (cem) EXPECT_GT(e, 1e-3);
  else EXPECT_EQ(e, 0.0);
}

// The full forward's logits handed over a few rows at a time (as `cemlm score` reduces them):
// every row once, in order, equal to the whole [N, V] (1e-5 relative: fewer rows may take
// another product kernel).
TEST_P(ModelTest, FullForwardInRowChunksEqualsTheWholeLogits) {
  const int N = 13, V = cfg_.vocab_size;
  for (int T : {1, 3}) {
    const auto ids = random_ids(N, V, 17 + T);
    const auto ref = full_forward(cfg_, w_, ids, T);
    for (int64_t per_call : {1, 4, 13, 64}) {
      std::vector<float> got;
      full_forward(cfg_, w_, ids, T, false, per_call,
                   [&](int64_t first, int64_t rows, const float* logits) {
                     ASSERT_EQ(first * V, int64_t(got.size()));
                     ASSERT_LE(rows, per_call);
                     got.insert(got.end(), logits, logits + rows * V);
                   });
      ASSERT_EQ(got.size(), ref.size()) << per_call;
      EXPECT_LT(rel_err(got.data(), ref.data(), ref.size()), 1e-5) << "T=" << T << " " << per_call;
    }
  }
}

// Prefill in random chunks through a paged cache with scattered blocks of size 3, then decode
// one token at a time: every position's logits equal the full forward (fp32, 1e-4 relative).
TEST_P(ModelTest, PagedChunkedDecodeEqualsFullForward) {
  const int N = 20, bs = 3, V = cfg_.vocab_size;
  for (int T : {1, 2, 4}) {
    auto ids = random_ids(N, V, 11 + T);
    auto ref = full_forward(cfg_, w_, ids, T);
    CpuModel model(cfg_, w_);
    KvPool kv(cfg_, bs, 16);
    std::vector<int32_t> table(16);
    std::iota(table.begin(), table.end(), 0);
    std::reverse(table.begin(), table.end());  // scattered: position 0 lives in the last block
    int pos = 0, chunk = 5;
    while (pos < N) {
      const int n = std::min(chunk, N - pos);
      Batch b;
      b.seqs.push_back(BatchSeq{ids.data() + pos, n, pos, T, table.data(), 16, false, true});
      std::vector<float> logits;
      model.forward(b, kv, &logits);
      ASSERT_EQ(logits.size(), size_t(n) * V);
      EXPECT_LT(rel_err(logits.data(), ref.data() + size_t(pos) * V, logits.size()), 1e-4)
          << "T=" << T << " chunk at " << pos;
      pos += n;
      chunk = chunk == 5 ? 1 : chunk == 1 ? 4 : 1;
    }
  }
}

// KvPool::copy_block for each cache dtype: a prompt prefilled into one set of blocks, its blocks
// copied to others, and the next token decoded once through each set: the same logits, bit for
// bit (a copy that missed a pool, or an int8 pool's scales, would read other entries).
TEST_P(ModelTest, CopiedBlocksDecodeAsTheOriginals) {
  const int N = 21, V = cfg_.vocab_size;
  const auto ids = random_ids(N + 1, V, 41);
  for (KvDtype dtype : {KvDtype::kFp32, KvDtype::kBf16, KvDtype::kInt8})
    for (int bs : {16, 3}) {  // tiled where AVX-512 is built; token-major
      CpuModel model(cfg_, w_, /*batch_invariant=*/true);
      const int per = (N + 1 + bs - 1) / bs;
      KvPool kv(cfg_, bs, 2 * per + 1, dtype);
      std::vector<int32_t> original(per), copy(per);
      for (int b = 0; b < per; ++b) original[b] = 2 * b + 1, copy[b] = 2 * b;
      std::vector<float> logits, from_original, from_copy;
      Batch prefill;
      prefill.seqs.push_back(BatchSeq{ids.data(), N, 0, 2, original.data(), per, false, true});
      model.forward(prefill, kv, &logits);
      for (int b = 0; b < per; ++b) kv.copy_block(original[b], copy[b]);
      for (auto [table, out] :
           {std::pair{&original, &from_original}, std::pair{&copy, &from_copy}}) {
        Batch step;
        step.seqs.push_back(BatchSeq{ids.data() + N, 1, N, 2, table->data(), per, false, true});
        model.forward(step, kv, out);
      }
      ASSERT_EQ(from_copy.size(), size_t(V));
      EXPECT_EQ(from_copy, from_original) << "dtype " << int(dtype) << " block size " << bs;
    }
}

// What a KvPool allocates per token is what ModelConfig::kv_bytes_per_token says (the budget's
// blocks are counted with it): fp32 and bf16 4 and 2 bytes a number; int8 one, and 4 per head of
// each key or value row and per context row.
TEST_P(ModelTest, KvPoolHoldsTheBytesPerTokenItIsBudgetedFor) {
  const int64_t numbers = cfg_.kv_floats_per_token_layer() * cfg_.n_layers;
  const bool standard = cfg_.attention == AttentionType::kStandard;
  const int64_t scales =
      cfg_.n_layers * (standard ? 2 * cfg_.n_heads : cfg_.n_heads + (cfg_.diag != DiagMode::kNone));
  for (auto [dtype, want] :
       {std::pair{KvDtype::kFp32, 4 * numbers}, std::pair{KvDtype::kBf16, 2 * numbers},
        std::pair{KvDtype::kInt8, numbers + 4 * scales}}) {
    EXPECT_EQ(cfg_.kv_bytes_per_token(dtype), want) << int(dtype);
    EXPECT_EQ(KvPool(cfg_, 16, 3, dtype).bytes_per_token(), want) << int(dtype);
    EXPECT_EQ(KvPool::blocks_for_budget(cfg_, 16, 160 * want, dtype), 10) << int(dtype);
    // Block ids are int32: a budget for more blocks gets as many as the ids can tell apart.
    EXPECT_EQ(KvPool::blocks_for_budget(cfg_, 1, INT64_MAX, dtype), INT32_MAX) << int(dtype);
  }
}

// Three sequences with different lengths and T in one batch equal each run alone.
TEST_P(ModelTest, MixedDepthBatchEqualsAlone) {
  const int V = cfg_.vocab_size, bs = 4;
  struct S { int n, T; std::vector<int> ids; std::vector<float> ref; };
  std::vector<S> seqs = {{9, 4, {}, {}}, {5, 2, {}, {}}, {13, 1, {}, {}}};
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].ids = random_ids(seqs[i].n, V, 100 + i);
    seqs[i].ref = full_forward(cfg_, w_, seqs[i].ids, seqs[i].T);
  }
  CpuModel model(cfg_, w_);
  KvPool kv(cfg_, bs, 12);
  std::vector<std::vector<int32_t>> tables = {{0, 5, 9}, {2, 11}, {1, 3, 4, 6}};
  Batch b;
  for (size_t i = 0; i < seqs.size(); ++i)
    b.seqs.push_back(BatchSeq{seqs[i].ids.data(), seqs[i].n, 0, seqs[i].T, tables[i].data(),
                              int(tables[i].size()), false, true});
  std::vector<float> logits;
  model.forward(b, kv, &logits);
  size_t off = 0;
  for (const auto& s : seqs) {
    EXPECT_LT(rel_err(logits.data() + off, s.ref.data(), s.ref.size()), 1e-4) << "T=" << s.T;
    off += s.ref.size();
  }
}

// A decode step of many sequences (every T from 4 down to 1, contexts across block boundaries)
// with a 12-token prefill chunk and a 3-token chunk among them, at 1, 2 and 3 threads: the CEM
// attention recursion then runs its short sequences in groups side by side and the long chunk
// with every thread. Each sequence's logits equal its full forward (1e-4 relative).
TEST_P(ModelTest, GroupedDecodeStepEqualsFullForward) {
  const int V = cfg_.vocab_size, bs = 4;
  struct S { int context, rows, T; std::vector<int> ids; std::vector<int32_t> blocks; };
  std::vector<S> seqs;
  for (int i = 0; i < 13; ++i) {
    const int T = 4 - (i * 4) / 13;  // sorted by T descending, as the engine batches them
    const int rows = i == 5 ? 12 : i == 9 ? 3 : 1, context = i == 5 ? 0 : 2 + (i * 7) % 17;
    seqs.push_back({context, rows, T, random_ids(context + rows, V, 300 + i), {}});
  }
  int32_t next_block = 0;
  for (S& s : seqs)
    for (int j = 0; j < (s.context + s.rows + bs - 1) / bs; ++j) s.blocks.push_back(next_block++);
  const int old_threads = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    CpuModel model(cfg_, w_);
    KvPool kv(cfg_, bs, next_block);
    std::vector<float> logits;
    for (const S& s : seqs) {  // each context prefilled alone
      if (s.context == 0) continue;
      Batch one;
      one.seqs.push_back(BatchSeq{s.ids.data(), s.context, 0, s.T, s.blocks.data(),
                                  int(s.blocks.size()), false, false});
      model.forward(one, kv, &logits);
    }
    Batch b;
    for (const S& s : seqs)
      b.seqs.push_back(BatchSeq{s.ids.data() + s.context, s.rows, s.context, s.T, s.blocks.data(),
                                int(s.blocks.size()), true, false});
    model.forward(b, kv, &logits);
    ASSERT_EQ(logits.size(), seqs.size() * size_t(V));
    for (size_t i = 0; i < seqs.size(); ++i) {
      const std::vector<float> ref = full_forward(cfg_, w_, seqs[i].ids, seqs[i].T);
      EXPECT_LT(rel_err(logits.data() + i * V, ref.data() + ref.size() - V, V), 1e-4)
          << "threads " << threads << " sequence " << i << " T=" << seqs[i].T;
    }
  }
  omp_set_num_threads(old_threads);
}

INSTANTIATE_TEST_SUITE_P(Variants, ModelTest, ::testing::ValuesIn(all_variants()),
                         [](const auto& info) { return info.param.name; });

// Whole pages inside t that are resident (mincore), and how many there are.
std::pair<int64_t, int64_t> resident_pages(const Tensor& t) {
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(t.data) + page - 1) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(t.data + t.numel())) & ~(page - 1);
  if (end <= begin) return {0, 0};
  std::vector<unsigned char> vec((end - begin) / page);
  if (mincore(reinterpret_cast<void*>(begin), end - begin, vec.data()) != 0) return {-1, 0};
  int64_t resident = 0;
  for (unsigned char v : vec) resident += v & 1;
  return {resident, int64_t(vec.size())};
}

// A CpuModel that owns its weights' memory (release_unread, as the engine's runner builds it)
// gives back the pages of exactly the weights it applies only through packed copies — every
// product weight, except a tied head, which is the embedding table — and its logits keep the
// bits of a model that keeps them (so it never reads what it released). Every variant, at a size
// where each weight spans whole pages.
TEST(CpuModelMemory, ReleasesTheCheckpointCopiesOfPackedWeightsOnly) {
  for (const Variant& v : all_variants()) {
    SCOPED_TRACE(v.name);
    ModelConfig c = make_config(v, 2048);
    c.d_model = 256, c.n_heads = 4, c.head_dim = 64, c.d_ff = 1024;
    ParamStore kept_store(c), released_store(c);
    randomize(kept_store, 5);
    std::copy(kept_store.flat().begin(), kept_store.flat().end(), released_store.flat().begin());
    const Weights kept_w = bind_weights(c, kept_store), released_w = bind_weights(c, released_store);
    const CpuModel kept(c, kept_w, true), released(c, released_w, true, WeightDtype::kFp32, true);
    std::vector<const float*> want;
    if (packed_weights_available()) {
      for (const LayerWeights& lw : released_w.layers)
        for (const Tensor* t : {&lw.wq, &lw.wk, &lw.wv, &lw.wo, &lw.w_gate, &lw.w_up, &lw.w_down})
          if (!t->empty()) want.push_back(t->data);
      if (!c.tie_output) want.push_back(released_w.lm_head.data);
    }
    std::vector<const float*> got;
    for (const Tensor& t : released.weights_left_unread()) {
      got.push_back(t.data);
      const auto [resident, pages] = resident_pages(t);
      EXPECT_GT(pages, 0);
      EXPECT_EQ(resident, 0) << "of " << pages << " pages";
    }
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want);
    // The kept model's copies are resident (mincore sees them), and its logits are the same.
    for (const Tensor& t : kept.weights_left_unread()) EXPECT_GT(resident_pages(t).first, 0);
    for (int T : {1, 3}) {
      const std::vector<int> ids = random_ids(9, c.vocab_size, 70 + T);
      std::vector<std::vector<float>> logits(2);
      for (int m = 0; m < 2; ++m) {
        KvPool kv(c, 4, 4);
        std::vector<int32_t> table = {0, 1, 2, 3};
        Batch b;
        b.seqs.push_back(BatchSeq{ids.data(), 9, 0, T, table.data(), 4, false, true});
        const_cast<CpuModel&>(m == 0 ? kept : released).forward(b, kv, &logits[m]);
      }
      ASSERT_EQ(logits[0].size(), logits[1].size());
      EXPECT_EQ(logits[0], logits[1]) << "T=" << T;
    }
  }
}

// The full-sequence forward (`cemlm score`, the trainer's evaluation) reads RoPE rows for the
// positions of its sequence only. It built them for the config's max_seq_len, which nothing in a
// checkpoint backs: a checkpoint of a few kilobytes claiming 4M positions made `cemlm score` of
// three tokens fill a 1 GiB table (64 GiB at head_dim 4096). The logits keep their bits.
TEST(CpuModelMemory, FullForwardDoesNotBuildTheRopeTableForMaxSeqLen) {
  ModelConfig c = make_config(all_variants()[3]);
  c.head_dim = 64;
  ParamStore store(c);
  randomize(store, 3);
  const Weights w = bind_weights(c, store);
  const std::vector<int> ids = random_ids(5, c.vocab_size, 11);
  const std::vector<float> want = full_forward(c, w, ids, 2);
  ModelConfig claims = c;
  claims.max_seq_len = 1 << 22;  // the config's limit; a table of 4M × 64 floats is 1 GiB
  auto peak_kb = [] {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return int64_t(ru.ru_maxrss);
  };
  const int64_t before = peak_kb();
  const std::vector<float> got = full_forward(claims, w, ids, 2);
  EXPECT_LT(peak_kb() - before, 256 << 10) << "KiB more at the peak";
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace cemlm
