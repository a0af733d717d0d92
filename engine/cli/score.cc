// `cemlm score`: log-probability of every token given its prefix, NLL and perplexity, computed
// with the full-sequence CPU forward (the oracle); optionally dumps the [N, V] logits.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cemlm/cli/commands.h"
#include "cemlm/cli/flags.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/engine/sampler.h"
#include "cemlm/engine/tokenizer.h"
#include "cemlm/engine/utf8.h"

namespace cemlm::cli {
namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "error: %s\n", msg.c_str());
  return 1;
}

}  // namespace

int cmd_score(int argc, char** argv) {
  std::string model, text, ids_text, dump;
  int T = 0, threads = 0;
  bool no_bos = false;
  Flags f("cemlm score --model DIR (--text STR | --ids 3,17,42) [--recursion T] [--dump-logits FILE]",
          "Prints JSON {\"tokens\", \"logprobs\", \"nll\", \"perplexity\", \"recursion\"}: the\n"
          "log-probability of each token given its prefix (the first token has none: null),\n"
          "computed with the full-sequence CPU forward at depth T (\"recursion\"). --text starts\n"
          "with the model's BOS, as every training document does, so that each of its tokens is\n"
          "scored.");
  f.add("model", &model, "checkpoint directory", true);
  f.add("text", &text, "text to score (needs the checkpoint's tokenizer.model)");
  f.add("ids", &ids_text, "comma-separated token ids to score (used as given)");
  f.add_bool("no-bos", &no_bos, "do not start --text with the model's BOS");
  f.add("recursion", &T, "recursion depth T (0: the model's recursion.default)");
  f.add("threads", &threads, kThreadsHelp);
  f.add("dump-logits", &dump,
        "write the logits as a safetensors file with one F32 tensor `logits` [N, V] (held whole "
        "in memory; without it they are reduced 256 rows at a time)");
  if (int rc = f.parse(argc, argv); rc >= 0) return rc;
  if (f.given("text") == f.given("ids"))
    return usage_error("give exactly one of --text and --ids (see --help)");
  if (no_bos && f.given("ids"))
    return usage_error("--no-bos applies to --text only: --ids are used as given");
  if (f.given("text") && text.empty())  // as `cemlm client score` refuses it
    return usage_error("--text is empty; give a text to score, or its ids as --ids");
  if (size_t valid = utf8_valid_prefix(text); valid != text.size())  // before the model loads
    return usage_error("--text is not valid UTF-8 (bad byte at offset " + std::to_string(valid) +
                       ")");
  std::vector<int> ids;
  if (f.given("ids")) {
    if (const std::string error = id_list_flag("--ids", ids_text, &ids); !error.empty())
      return usage_error(error);
    if (ids.size() < 2)  // the first token is not scored: nothing would be
      return usage_error("--ids: need at least 2 tokens to score (got " +
                         std::to_string(ids.size()) + ")");
  }
  if (const std::string error = recursion_flag_error(T); !error.empty()) return usage_error(error);
  if (const std::string error = threads_flag_error(threads); !error.empty())
    return usage_error(error);

  // Checked before the forward: a path it cannot take was refused only once that had run.
  if (std::string err;
      f.given("dump-logits") && !check_out_file("--dump-logits", dump, "logits.safetensors", false,
                                                &err, checkpoint_file_paths(model)))
    return fail(err);
  if (const std::string err = checkpoint_file_error("--dump-logits", dump);
      f.given("dump-logits") && !err.empty())
    return fail(err);
  auto ck = load_checkpoint(model);
  if (!ck.ok()) return fail(std::string(ck.status().message()));
  const ModelConfig& c = ck->config;
  int bos = -1;  // the id put before --text's tokens, if any
  if (!f.given("ids")) {
    if (ck->tokenizer_path.empty())
      return fail("--text: the checkpoint '" + model + "' has no tokenizer.model; use --ids");
    std::string err;
    auto tok = Tokenizer::load(ck->tokenizer_path, &err, c.vocab_size);
    if (!tok) return fail(err);
    if (!check_tokenizer_fits(*tok, c.vocab_size, &err)) return fail(ck->tokenizer_path + ": " + err);
    bos = no_bos ? -1 : resolve_bos_id(c.bos_id, tok.get());
    auto encoded = encode_input(*tok, text, bos, &err);
    if (!encoded) return fail("--text: " + err + "; use --ids");
    ids = *std::move(encoded);
  }
  // The count names where the tokens came from (with the BOS --text starts with, as generate's).
  const std::string input = f.given("ids") ? "--ids"
                            : bos < 0      ? "--text (as tokens)"
                                           : "--text (as tokens, BOS included)";
  if (ids.size() < 2)
    return fail(input + " has " + std::to_string(ids.size()) +
                (ids.size() == 1 ? " token" : " tokens") +
                "; need at least 2 to score (the first is not scored): give a longer text");
  if (int(ids.size()) > c.max_seq_len)
    return fail(input + " has " + std::to_string(ids.size()) +
                " tokens; the model's max_seq_len is " + std::to_string(c.max_seq_len) +
                (f.given("ids") ? ": give fewer ids" : ": score a shorter text"));
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= c.vocab_size)
      return fail("--ids[" + std::to_string(i) + "] = " + std::to_string(ids[i]) +
                  " is not a token id in [0, " + std::to_string(c.vocab_size) + ")");
  if (absl::Status st = check_recursion_depth(c, T, "--recursion"); !st.ok())
    return fail(std::string(st.message()));
  if (T == 0) T = c.recursion_default;

  use_cpu_threads(threads);  // as the engine does: by default the CPU limit, not every core
  const Weights w = bind_weights(c, ck->params);
  if (c.embedding == EmbeddingType::kLev) {
    // The text's embeddings alone (the forward builds the whole table): one that overflows would
    // fail only as "non-finite logits", without its cause.
    std::vector<float> embedded(ids.size() * size_t(c.d_model));
    lev_forward_f64(Tensor(embedded.data(), {int64_t(ids.size()), c.d_model}), ids.data(),
                    lev_weights(w));
    if (const int64_t i = first_nonfinite_row(embedded.data(), int64_t(ids.size()), c.d_model);
        i >= 0)
      return fail(std::string(lev_embedding_error(ids[size_t(i)]).message()));
  }
  std::vector<double> logprobs;
  double nll = 0;
  std::string bad;
  // Row i's logits score ids[i + 1] (the last row's, nothing).
  auto score_rows = [&](int64_t first, int64_t rows, const float* logits) {
    const size_t V = size_t(c.vocab_size);
    for (int64_t k = 0; k < rows && bad.empty(); ++k) {
      const size_t i = size_t(first + k);
      if (i + 1 >= ids.size()) return;
      std::span<const float> row(logits + size_t(k) * V, V);
      const LogNormalizer norm = log_normalizer(row);
      const double lp = norm.logprob(row[size_t(ids[i + 1])]);
      // The server's Score keeps float logprobs: one past the float range fails both alike.
      if (!norm.finite() || !std::isfinite(float(lp))) {
        bad = std::string("the model produced ") +
              (norm.finite() ? "a log-probability below the float range" : "non-finite logits") +
              " at position " + std::to_string(i);
        return;
      }
      logprobs.push_back(lp);
      nll -= lp;
    }
  };
  // The weights are not needed after: packed, their pages go back (peak ~1.5x the file, not 2.5x).
  std::vector<float> logits;  // [N, V], for --dump-logits only
  if (dump.empty()) {
    // 256 rows of logits at a time (32 MB for a 32K vocabulary): the whole [N, V] was 781 MB for
    // 4,096 tokens.
    full_forward(c, w, ids, T, /*release_weights=*/true, 256, score_rows);
  } else {
    logits = full_forward(c, w, ids, T, /*release_weights=*/true);
    score_rows(0, int64_t(ids.size()), logits.data());
  }
  if (!bad.empty()) return fail(bad);
  nll /= double(ids.size() - 1);
  const absl::StatusOr<double> perplexity = perplexity_of(nll);
  if (!perplexity.ok()) return fail(std::string(perplexity.status().message()));
  if (!dump.empty()) {
    auto st = write_safetensors(
        dump, {NamedTensor{"logits", {int64_t(ids.size()), int64_t(c.vocab_size)}, logits}});
    if (!st.ok()) return fail("--dump-logits: " + std::string(st.message()));
  }
  std::printf("%s\n", score_json(ids, logprobs, nll, *perplexity, T).c_str());
  return 0;
}

}  // namespace cemlm::cli
