// Attention alone, as the engine's CEM sub-layers run it: B decode rows, each attending to its own
// context of C cached tokens through a shuffled block table, or (--prefill) one sequence's C rows
// each attending to the tokens up to its own, over the base shape's 12 layers (16 heads × 64, D
// 1024, shared diagonal: a key row and a context row per token), each layer's cache its own.
// Prints ms per 12 layers and, for decode, the rate at which the cache's bytes go by (each read
// once), for the fp32, bf16 or int8 cache. No model, no products: changes to the attention passes
// show here without the step's other 60–90%.
#include "cemlm/kernels/attention.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cemlm/kernels/bf16.h"
#include "cemlm/kernels/huge_pages.h"
#include "machine.h"

using namespace cemlm;

namespace {

constexpr int kLayers = 12, kHeads = 16, kWidth = 1024, kBlock = 16;

enum class Dtype { kFp32, kBf16, kInt8 };

struct Pools {
  HugePageVector<float> k, c;
  HugePageVector<uint16_t> k16, c16;
  HugePageVector<int8_t> k8, c8;
  HugePageVector<float> k_scale, c_scale;
};

// Cache bytes per token and layer: a key row and a context row (and their scales).
double bytes_per_token(Dtype d) {
  return d == Dtype::kInt8 ? 2 * kWidth + 4 * (kHeads + 1)
                           : 2 * kWidth * (d == Dtype::kBf16 ? 2 : 4);
}

// rows = 0: one sequence's prefill of `context` rows.
double ms_per_step(int rows, int context, Dtype dtype) {
  const bool prefill = rows == 0;
  const int per_row = (context + kBlock - 1) / kBlock, n_blocks = std::max(rows, 1) * per_row;
  const size_t floats = size_t(n_blocks) * kBlock * kWidth;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  std::vector<Pools> layers(kLayers);
  std::vector<float> fill(floats);
  std::uniform_int_distribution<int> int8(-127, 127);
  for (Pools& p : layers)
    for (auto [f32, f16, i8] : {std::tuple{&p.k, &p.k16, &p.k8}, std::tuple{&p.c, &p.c16, &p.c8}}) {
      if (dtype != Dtype::kInt8)
        for (float& x : fill) x = normal(rng);
      if (dtype == Dtype::kInt8) {
        i8->resize(floats);
        for (int8_t& x : *i8) x = int8_t(int8(rng));
      } else if (dtype == Dtype::kBf16) {
        f16->resize(floats);
        f32_to_bf16(fill.data(), f16->data(), int64_t(floats));
      } else {
        f32->assign(fill.begin(), fill.end());
      }
    }
  if (dtype == Dtype::kInt8)
    for (Pools& p : layers) {  // a row's largest magnitude / 127 at the fp32 pools' spread
      p.k_scale.assign(size_t(n_blocks) * kBlock * kHeads, 0.3f / 127);
      p.c_scale.assign(size_t(n_blocks) * kBlock, 0.4f / 127);
    }
  std::vector<int32_t> blocks(static_cast<size_t>(n_blocks));
  for (int i = 0; i < n_blocks; ++i) blocks[size_t(i)] = i;
  std::shuffle(blocks.begin(), blocks.end(), rng);  // as after a while of serving
  std::vector<AttnSeq> seqs;
  for (int s = 0; s < rows; ++s)
    seqs.push_back(AttnSeq{s, 1, context - 1, blocks.data() + size_t(s) * per_row});
  if (prefill) seqs.push_back(AttnSeq{0, context, 0, blocks.data()});
  const int n_rows = prefill ? context : rows, n_seqs = int(seqs.size());
  std::vector<float> q(size_t(n_rows) * kWidth), qd(q.size()), out(q.size()), oc(q.size());
  for (float& x : q) x = 10 * normal(rng);
  for (float& x : qd) x = normal(rng);
  std::vector<KvLayerView> views(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    KvLayerView& v = views[size_t(l)];
    v.block_size = kBlock, v.n_heads = kHeads, v.k_width = kWidth, v.c_width = kWidth;
    v.tiled = true;  // the CPU runner's layout
    Pools& p = layers[size_t(l)];
    if (dtype == Dtype::kInt8)
      v.k8 = p.k8.data(), v.c8 = p.c8.data(), v.k_scale = p.k_scale.data(),
      v.c_scale = p.c_scale.data();
    else if (dtype == Dtype::kBf16)
      v.k16 = p.k16.data(), v.c16 = p.c16.data();
    else
      v.k = p.k.data(), v.c = p.c.data();
  }
  std::vector<float> scratch(
      size_t(paged_attention_scratch_floats(seqs.data(), n_seqs, views[0], DiagKind::kShared)));
  ExecCtx ctx;
  ctx.scratch = scratch.data();
  ctx.scratch_floats = int64_t(scratch.size());
  ctx.batch_invariant = true;  // the engine's setting: every row on the one-row path
  const auto step = [&] {
    for (const KvLayerView& v : views)
      paged_attention_forward(
          ctx, Tensor(out.data(), {n_rows, kWidth}), Tensor(oc.data(), {n_rows, kWidth}),
          Tensor(q.data(), {n_rows, kWidth}), Tensor(qd.data(), {n_rows, kWidth}),
          DiagKind::kShared, v, seqs.data(), n_seqs, 0.125f);
  };
  return 1e3 * bench::seconds_per_call(step, 2.0);
}

std::vector<int> int_list(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    const long v = std::strtol(p, &end, 10);
    if (end == p || v < 1 || v > 1 << 16 || (*end && *end != ',')) return {};
    out.push_back(int(v));
    p = *end ? end + 1 : end;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> rows = {1, 32}, contexts = {128, 512, 1024};
  std::vector<int> prefills;
  Dtype dtype = Dtype::kFp32;
  bool rows_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--bf16" || a == "--int8") {
      const Dtype d = a == "--bf16" ? Dtype::kBf16 : Dtype::kInt8;
      if (dtype != Dtype::kFp32 && dtype != d) {  // the later one won, unsaid
        std::fprintf(stderr, "--bf16 and --int8 are one cache each: give one of them\n");
        return 2;
      }
      dtype = d;
    } else if ((a == "--rows" || a == "--contexts" || a == "--prefill") && i + 1 < argc) {
      std::vector<int>& list = a == "--rows" ? rows : a == "--contexts" ? contexts : prefills;
      rows_given |= a == "--rows";
      list = int_list(argv[++i]);
      if (list.empty()) {
        std::fprintf(stderr, "%s %s: expected comma-separated integers >= 1\n", a.c_str(), argv[i]);
        return 2;
      }
    } else if (a != "--help" && a != "-h") {  // usage went to stdout, naming nothing
      const bool takes_value = a == "--rows" || a == "--contexts" || a == "--prefill";
      std::fprintf(stderr, "%s %s; see --help\n",
                   takes_value ? "a value is needed after" : "unknown argument", a.c_str());
      return 2;
    } else {
      std::printf(
          "usage: attention [--rows 1,32] [--contexts 128,512,1024] [--prefill N,…] [--bf16 |\n"
          "                 --int8]\n\n"
          "Attention alone over the base shape's 12 layers (16 heads x 64, shared diagonal):\n"
          "B decode rows, each with its own context of C cached tokens (fp32, or bf16 with\n"
          "--bf16, int8 with --int8), then with --prefill one sequence's N rows attending causally "
          "(the\n"
          "engine's one-row path). Prints ms per 12 layers and, for decode, the cache's bytes\n"
          "per second.\n");
      return 0;
    }
  }
  std::printf("%s\n", bench::machine_line().c_str());
  std::printf("decode attention, 12 layers, %s cache\n\n", dtype == Dtype::kInt8   ? "int8"
                                                           : dtype == Dtype::kBf16 ? "bf16"
                                                                                   : "fp32");
  std::printf("| rows | context | ms per step | cache GB/s |\n|---|---|---|---|\n");
  if (!prefills.empty() && !rows_given) rows.clear();  // --prefill alone: no decode rows
  for (int r : rows)
    for (int c : contexts) {
      const double ms = ms_per_step(r, c, dtype);
      const double bytes = double(kLayers) * r * c * bytes_per_token(dtype);
      std::printf("| %d | %d | %.2f | %.1f |\n", r, c, ms, bytes / ms / 1e6);
      std::fflush(stdout);
    }
  for (int n : prefills) {
    std::printf("| prefill | %d | %.2f | |\n", n, ms_per_step(0, n, dtype));
    std::fflush(stdout);
  }
  return 0;
}
