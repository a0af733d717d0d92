// `cemlm generate`: one request through the Engine (paged KV cache, scheduler, sampler: the same
// code path as the server). Streams the text to stdout, or prints one JSON object with --json.
#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cemlm/cli/commands.h"
#include "cemlm/cli/flags.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/engine.h"
#include "cemlm/engine/model_runner.h"
#include "cemlm/engine/sampling.h"
#include "cemlm/engine/tokenizer.h"
#include "cemlm/engine/utf8.h"
#include "nlohmann/json.hpp"

namespace cemlm::cli {
namespace {

int fail(const std::string& msg) {
  std::fprintf(stderr, "error: %s\n", msg.c_str());
  return 1;
}

// What the request streamed back, gathered on the engine thread.
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::vector<int> ids;
  std::vector<float> logprobs;
  std::vector<std::vector<TopLogprob>> top_logprobs;
  std::string text;
  FinishReason reason = FinishReason::kNone;
  absl::Status error;
  Usage usage;
  RequestTimings timings;
};

}  // namespace

int cmd_generate(int argc, char** argv) {
  std::string model, prompt, prompt_ids, seed_text, device = "cpu", kv_dtype = "fp32";
  std::string kv_memory = "256M", stop_token_ids, logit_bias;
  std::vector<std::string> stop;
  int T = 0, max_new = 64, min_new = 0, top_k = 0, top_logprobs = 0, threads = 0;
  float temperature = 1.0f, top_p = 1.0f, min_p = 0.0f;
  float repetition_penalty = 1.0f, presence_penalty = 0.0f, frequency_penalty = 0.0f;
  bool json = false, no_bos = false, ignore_eos = false;
  Flags f(
      "cemlm generate --model DIR (--prompt STR | --prompt-ids 3,17) [--recursion T] "
      "[--max-new-tokens N] [--temperature X] [--top-k K] [--top-p P] [--min-p P] "
      "[--stop STR...] [--seed S] [--json] [options]",
      "Generate a continuation through the inference engine (paged KV cache, same code path\n"
      "as the server). Streams the text to stdout; with --json prints\n"
      "{\"ids\", \"text\", \"logprobs\", \"finish_reason\", \"seed\", \"usage\", \"timing\"}, "
      "where\n"
      "logprobs[i] is the log-probability of ids[i] under the unmodified model distribution,\n"
      "seed the sampling seed (drawn when --seed is not given; pass it back to reproduce the\n"
      "output), and usage and timing the engine's counts and seconds, as `cemlm client generate\n"
      "--json` prints them (timing's e2e_seconds minus first_token_seconds is the decode time of\n"
      "the tokens after the first, without process start or model load); with --top-logprobs K\n"
      "also \"top_logprobs\": per token, the K most likely [{\"id\", \"logprob\"}].");
  f.add("model", &model, "checkpoint directory", true);
  f.add("prompt", &prompt, "prompt text (needs the checkpoint's tokenizer.model)");
  f.add("prompt-ids", &prompt_ids, "prompt as comma-separated token ids (used as given)");
  f.add_bool("no-bos", &no_bos,
             "do not start --prompt with the model's BOS (training starts every document with it)");
  f.add("recursion", &T, "recursion depth T (0: the model's recursion.default)");
  f.add("max-new-tokens", &max_new,
        "tokens to generate at most; when not given, the default is capped to the room the "
        "prompt leaves below the model's max_seq_len");
  f.add("min-new-tokens", &min_new,
        "tokens to generate before end-of-sequence or --stop-token-ids may be drawn (--stop "
        "strings still apply)");
  f.add("temperature", &temperature, "sampling temperature (0: greedy)");
  f.add("top-k", &top_k, "keep the K most likely tokens (0: off)");
  f.add("top-p", &top_p, "nucleus sampling mass (1: off)");
  f.add("min-p", &min_p, "drop tokens below P times the top probability, in [0, 1] (0: off)");
  f.add("repetition-penalty", &repetition_penalty,
        "CTRL-style penalty on prompt and generated tokens, in [0.01, 100] (1: off)");
  f.add("presence-penalty", &presence_penalty,
        "subtracted from the logit of every generated token, in [-2, 2] (0: off)");
  f.add("frequency-penalty", &frequency_penalty,
        "subtracted once per occurrence of a generated token, in [-2, 2] (0: off)");
  f.add_list("stop", &stop,
             "stop strings (at most 16, each at most 1024 bytes; repeatable): generation ends "
             "before the first one, which is not printed");
  f.add("stop-token-ids", &stop_token_ids,
        "comma-separated token ids that end generation (not printed), like 2,7");
  f.add_bool("ignore-eos", &ignore_eos, "keep generating after the model's end-of-sequence id");
  f.add("logit-bias", &logit_bias,
        "ID:BIAS pairs like 17:-100,42:2.5: BIAS in [-100, 100] added to token ID's logit after "
        "the penalties, before the temperature divides it (-100 bans it at temperatures up to a "
        "few); --json logprobs stay the unmodified model's");
  f.add("top-logprobs", &top_logprobs, "alternatives reported per token with --json, 0-20");
  f.add("seed", &seed_text, "sampling seed, an integer in [0, 2^64) (random when not given)");
  f.add("device", &device,
        "cpu | cpu:bf16 | cpu:int8 (weights in bf16 or block-scaled int8: less memory, faster "
        "decode, logprobs move a little) | cpu:bf16dot | cpu:int8dot (those weights and product "
        "inputs, with dot-product instructions: faster batches and prefill) | cuda (= cuda:bf16) "
        "| cuda:fp32");
  f.add("kv-cache-memory", &kv_memory,
        "KV-cache budget in bytes (K/M/G/T suffixes); a model whose max_seq_len does not fit "
        "needs more");
  f.add("kv-cache-dtype", &kv_dtype,
        "fp32 | bf16 | int8 (CPU: bf16 half the cache bytes, entries rounded (keys and the "
        "diag term's contexts); int8 about a quarter, entries quantized with a scale per head of "
        "each key row and one per context row)");
  f.add("threads", &threads, kThreadsHelp);
  f.add_bool("json", &json, "print one JSON object instead of streaming text");
  if (int rc = f.parse(argc, argv); rc >= 0) return rc;
  if (f.given("prompt") == f.given("prompt-ids"))
    return usage_error("give exactly one of --prompt and --prompt-ids (see --help)");
  if (no_bos && f.given("prompt-ids"))
    return usage_error("--no-bos applies to --prompt only: --prompt-ids are used as given");
  if (no_bos && f.given("prompt") && prompt.empty())  // as `cemlm client generate` refuses it
    return usage_error(
        "--prompt is empty and --no-bos leaves out the BOS: nothing to generate from; give a "
        "prompt");

  if (top_logprobs > 0 && !json)
    return usage_error("--top-logprobs needs --json: the streamed text has no place for them");
  std::vector<int> stop_ids;
  if (f.given("stop-token-ids"))
    if (const std::string error = id_list_flag("--stop-token-ids", stop_token_ids, &stop_ids);
        !error.empty())
      return usage_error(error);
  std::vector<std::pair<int, float>> bias;
  if (f.given("logit-bias"))
    if (const std::string error = logit_bias_flag(logit_bias, &bias); !error.empty())
      return usage_error(error);
  int64_t kv_bytes = 0;
  if (const std::string error = kv_cache_memory_flag(kv_memory, &kv_bytes); !error.empty())
    return usage_error(error);
  // What can be wrong whatever the model is, refused before it loads (exit 2): a typo must not
  // wait for a large model's load, nor exit as a refusal of the model's would.
  if (size_t valid = utf8_valid_prefix(prompt); valid != prompt.size())
    return usage_error("--prompt is not valid UTF-8 (bad byte at offset " + std::to_string(valid) +
                       ")");
  RunnerOptions runner;
  runner.device = device;
  runner.kv_cache_dtype = kv_dtype;
  runner.threads = threads;
  if (absl::Status st = check_runner_options(runner); !st.ok())
    return usage_error(std::string(st.message()));
  GenerateRequest req;
  if (f.given("prompt-ids"))
    if (const std::string error = id_list_flag("--prompt-ids", prompt_ids, &req.prompt_ids);
        !error.empty())
      return usage_error(error);
  if (const std::string error = recursion_flag_error(T); !error.empty()) return usage_error(error);
  req.recursion_depth = T;
  req.sampling.max_new_tokens = max_new;
  req.sampling.min_new_tokens = min_new;
  req.sampling.logit_bias = bias;
  req.sampling.temperature = temperature;
  req.sampling.top_k = top_k;
  req.sampling.top_p = top_p;
  req.sampling.min_p = min_p;
  req.sampling.repetition_penalty = repetition_penalty;
  req.sampling.presence_penalty = presence_penalty;
  req.sampling.frequency_penalty = frequency_penalty;
  req.sampling.stop = stop;
  req.sampling.stop_token_ids = stop_ids;
  req.sampling.ignore_eos = ignore_eos;
  req.sampling.top_logprobs = top_logprobs;
  {
    // Ids are left to the model's check, which knows its vocabulary; an unset --max-new-tokens
    // is its default here (the model's context may lower it later, never raise it).
    SamplingParams alone = req.sampling;
    auto model_judges = [](int id) { return id < 0 || id == INT32_MAX; };
    std::erase_if(alone.stop_token_ids, model_judges);
    std::erase_if(alone.logit_bias, [&](const auto& b) { return model_judges(b.first); });
    absl::Status st = f.given("max-new-tokens")
                          ? absl::OkStatus()
                          : cap_unset_max_new_tokens(INT32_MAX, 0, "", &alone);
    if (st.ok()) st = validate_sampling(alone, INT32_MAX);
    if (!st.ok()) return usage_error(in_flag_terms(std::string(st.message())));
  }
  uint64_t seed = 0;
  if (f.given("seed")) {
    if (!parse_uint64(seed_text, &seed))
      return usage_error("--seed: expected an integer in [0, 2^64), got '" + seed_text + "'");
  } else {  // drawn here, so that --json can report it and the sample can be reproduced
    std::random_device rd;
    seed = ((uint64_t(rd()) << 32) | rd()) >> 11;  // below 2^53, as the engine's (engine.cc)
  }
  req.sampling.seed = seed;

  EngineOptions eo;
  eo.model_dir = model;
  eo.device = device;
  eo.kv_cache_dtype = kv_dtype;
  eo.threads = threads;
  eo.kv_cache_memory = kv_bytes;
  auto engine = Engine::create(eo);
  if (!engine.ok()) return fail(std::string(engine.status().message()));
  // Streamed, the tokens of a model without a tokenizer printed as nothing: an empty line, exit 0.
  if (!json && !(*engine)->tokenizer())
    return fail("the checkpoint '" + model +
                "' has no tokenizer.model, so its tokens have no text to stream; add --json to "
                "get the generated ids" +
                (f.given("prompt") ? " (and give the prompt as --prompt-ids: it has no text "
                                     "either)"
                                   : ""));

  req.prompt_field = "--prompt-ids";
  if (!f.given("prompt-ids")) {
    const Tokenizer* tok = (*engine)->tokenizer();
    if (!tok)
      return fail("--prompt: the checkpoint '" + model +
                  "' has no tokenizer.model; use --prompt-ids");
    // The count in errors says whether a BOS is in it (a model may have none).
    const int bos = no_bos ? -1 : resolve_bos_id((*engine)->config().bos_id, tok);
    req.prompt_field = bos < 0 ? "--prompt (as tokens)" : "--prompt (as tokens, BOS included)";
    std::string error;
    auto ids = encode_input(*tok, prompt, bos, &error);
    if (!ids) return fail("--prompt: " + error + "; use --prompt-ids");
    req.prompt_ids = *std::move(ids);
  }
  // The default fits small models too; a value given stays as given, and too large is an error.
  if (!f.given("max-new-tokens"))
    if (absl::Status st =
            cap_unset_max_new_tokens((*engine)->config().max_seq_len, int(req.prompt_ids.size()),
                                     req.prompt_field, &req.sampling);
        !st.ok())
      return fail(in_flag_terms(std::string(st.message())));

  Outcome out;
  auto on_event = [&out, json](const StreamEvent& ev) {
    if (!json) {
      // The whole piece: byte-fallback tokens may decode to a NUL, which fputs would stop at.
      std::fwrite(ev.text.data(), 1, ev.text.size(), stdout);
      std::fflush(stdout);
    }
    std::lock_guard<std::mutex> lock(out.mu);
    out.ids.insert(out.ids.end(), ev.token_ids.begin(), ev.token_ids.end());
    out.logprobs.insert(out.logprobs.end(), ev.logprobs.begin(), ev.logprobs.end());
    out.top_logprobs.insert(out.top_logprobs.end(), ev.top_logprobs.begin(), ev.top_logprobs.end());
    out.text += ev.text;
    if (ev.finish_reason == FinishReason::kNone) return;
    out.reason = ev.finish_reason;
    out.error = ev.error;
    out.usage = ev.usage;
    out.timings = ev.timings;
    out.done = true;
    out.cv.notify_all();
  };
  if (auto id = (*engine)->submit(std::move(req), on_event); !id.ok())
    return fail(in_flag_terms(std::string(id.status().message())));
  {
    std::unique_lock<std::mutex> lock(out.mu);
    out.cv.wait(lock, [&] { return out.done; });
  }
  (*engine)->shutdown(false);
  if (out.reason == FinishReason::kError) return fail(std::string(out.error.message()));
  if (!json) {
    std::fputs("\n", stdout);
    // A drawn seed is reported (--json has it as "seed"), so that a sample can be made again.
    if (!f.given("seed") && temperature >= kGreedyBelowTemperature)
      std::fprintf(stderr, "seed %llu (--seed %llu makes this sample again)\n",
                   (unsigned long long)seed, (unsigned long long)seed);
    return 0;
  }
  nlohmann::json j;
  j["ids"] = out.ids;
  j["text"] = out.text;
  j["logprobs"] = out.logprobs;
  if (top_logprobs > 0) {  // per token: [{"id", "logprob"}, ...], as `cemlm client generate` prints
    nlohmann::json tops = nlohmann::json::array();
    for (const auto& alts : out.top_logprobs) {
      nlohmann::json a = nlohmann::json::array();
      for (const TopLogprob& t : alts) a.push_back({{"id", t.token_id}, {"logprob", t.logprob}});
      tops.push_back(std::move(a));
    }
    j["top_logprobs"] = std::move(tops);
  }
  j["finish_reason"] = finish_reason_name(out.reason);
  j["seed"] = seed;
  const Usage& u = out.usage;
  j["usage"] = {{"prompt_tokens", u.prompt_tokens},
                {"generated_tokens", u.generated_tokens},
                {"recursion_steps", u.recursion_steps},
                {"cached_prompt_tokens", u.cached_prompt_tokens}};
  const RequestTimings& t = out.timings;
  j["timing"] = {{"queue_seconds", queue_seconds(t)},
                 {"first_token_seconds", seconds_between(t.submitted, t.first_token)},
                 {"e2e_seconds", seconds_between(t.submitted, t.finished)}};
  std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  return 0;
}

}  // namespace cemlm::cli
