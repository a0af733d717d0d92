// bench/sampler: milliseconds per draw of the CPU sampler (one row, one thread) over vocabularies
// of 32,000, 128,256 and 262,144 ids, for each filter, on two kinds of rows: "flat" (logits
// N(0, 3²)) and "sure" (N(0, 2²) with 20 ids 12 higher: a model sure of a few tokens, as most of
// a language model's rows are). "first" is a new request's first draw (on a thread that has
// drawn before), "next" its later ones. A second table gives the stop-string matcher's
// microseconds per 4-byte token piece. Prints tables; see docs/BENCHMARKS.md.
#include "cemlm/engine/sampler.h"

#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "machine.h"

namespace {

using namespace cemlm;

struct Filter {
  const char* name;
  SamplingParams params;
};

std::vector<Filter> filters() {
  std::vector<Filter> f(7);
  f[0].name = "greedy", f[0].params.temperature = 0;
  f[1].name = "T=1";
  f[2].name = "top_p=0.9", f[2].params.top_p = 0.9f;
  f[3].name = "top_k=50", f[3].params.top_k = 50;
  f[4].name = "min_p=0.05", f[4].params.min_p = 0.05f;
  f[5].name = "top_p+penalties", f[5].params.top_p = 0.9f;
  f[5].params.repetition_penalty = 1.1f, f[5].params.presence_penalty = 0.5f;
  f[6].name = "greedy+top_logprobs=5", f[6].params.temperature = 0;
  f[6].params.top_logprobs = 5;
  return f;
}

std::vector<float> row(int V, bool sure) {
  std::mt19937 gen(1);
  std::normal_distribution<float> normal(0.0f, sure ? 2.0f : 3.0f);
  std::vector<float> r(size_t(V), 0.0f);
  for (float& x : r) x = normal(gen);
  if (sure)
    for (int i = 0; i < 20; ++i) r[size_t(i) * 7919 % size_t(V)] += 12;
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage =
      "usage: sampler\n\n"
      "Milliseconds per draw of the CPU sampler on one thread, by vocabulary size, filter and\n"
      "row kind (flat logits, or a model sure of a few tokens), then microseconds per token of\n"
      "the stop-string matcher; takes no arguments.\n";
  if (argc == 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h"))
    return std::fputs(usage, stdout), 0;
  if (argc > 1) return std::fprintf(stderr, "unexpected argument '%s'\n%s", argv[1], usage), 2;
  std::printf("%s\n\n", bench::machine_line().c_str());
  std::printf("| V | filter | flat first | flat next | sure first | sure next |\n");
  std::printf("|---|---|---|---|---|---|\n");
  // A history of 256 tokens (the penalties' work), the first 64 the prompt.
  std::vector<int> history;
  for (int i = 0; i < 256; ++i) history.push_back(i * 37 % 30000);
  for (int V : {32000, 128256, 262144}) {
    const std::vector<float> rows[2] = {row(V, false), row(V, true)};
    // Untimed: the thread's draw buffers grow to this vocabulary once, not in the first cell.
    (void)Sampler(filters().front().params, -1, 1).sample(rows[0], history, 64);
    for (const Filter& f : filters()) {
      double first[2] = {}, next[2] = {};
      for (int kind = 0; kind < 2; ++kind) {
        constexpr int kRequests = 20;
        for (int r = 0; r < kRequests; ++r) {
          Sampler s(f.params, -1, uint64_t(r + 1));
          const auto t0 = std::chrono::steady_clock::now();
          (void)s.sample(rows[kind], history, 64);
          first[kind] +=
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
              kRequests;
        }
        Sampler s(f.params, -1, 1);
        next[kind] = bench::seconds_per_call([&] { (void)s.sample(rows[kind], history, 64); });
      }
      std::printf("| %d | %s | %.3f | %.3f | %.3f | %.3f |\n", V, f.name, first[0] * 1e3,
                  next[0] * 1e3, first[1] * 1e3, next[1] * 1e3);
    }
  }
  // Stop strings: the most a request may give (16 of 1,024 bytes) on text that keeps almost
  // matching them (a 1,023-byte tail held back, each stop string agreeing with it for a while),
  // and a few short ones on plain text.
  std::printf("\n| stop strings | text | µs per 4-byte piece |\n|---|---|---|\n");
  std::vector<std::string> worst;
  for (int i = 1; i < kMaxStopStrings; ++i) {  // aⁿbaᵐ, n = 64, 128, …
    const size_t n = size_t(64 * i);
    worst.push_back(std::string(n, 'a') + "b" + std::string(size_t(kMaxStopBytes) - n - 1, 'a'));
  }
  worst.push_back(std::string(kMaxStopBytes - 1, 'a') + "b");
  const struct {
    const char* stops_name;
    std::vector<std::string> stops;
    const char* text_name;
    std::string piece;
  } cases[] = {
      {"16 × 1,024 B (aⁿbaᵐ)", worst, "aaaa…", "aaaa"},
      {"4 × 3-10 B", {"\n\nUser:", "</answer>", "###", "<|im_end|>"}, "prose", "text"},
  };
  for (const auto& c : cases) {
    StopMatcher m(c.stops);
    bool stopped = false;
    for (int i = 0; i < kMaxStopBytes; ++i) (void)m.push(c.piece, &stopped);  // all held back
    const double t = bench::seconds_per_call([&] { (void)m.push(c.piece, &stopped); });
    std::printf("| %s | %s | %.3f |\n", c.stops_name, c.text_name, t * 1e6);
  }
}
