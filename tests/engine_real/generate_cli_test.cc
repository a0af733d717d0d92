// `cemlm generate` through its entry point on a random-init checkpoint: the --json object's ids
// and logprobs (each the log-probability of ids[i] under the unmodified model, checked against
// the full-sequence forward), the KV-cache flags, the sampling flags (stop strings and ids,
// penalties, top logprobs), the streamed text byte for byte, and the errors that name a bad flag.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "../tokenizer/test_files.h"
#include "cemlm/cli/commands.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/corpus.h"
#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/tokenizer.h"
#include "ref_log_softmax.h"
#include "temp_dir.h"
#include "tiny_models.h"

namespace cemlm {
namespace {

int run(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return cli::cmd_generate(int(argv.size()), argv.data());
}

class GenerateCli : public ::testing::Test {
 protected:
  void SetUp() override {
    testing_models::Variant v = testing_models::all_variants()[5];  // full CEM with LEV
    cfg_ = testing_models::make_config(v);
    cfg_.recursion_default = 2;
    cfg_.eos_id = -1;  // no stop token: every run generates max_new_tokens
    ParamStore store(cfg_);
    testing_models::randomize(store, 3);
    dir_ = testing_temp::fresh_dir("generate_cli");
    ASSERT_TRUE(save_checkpoint(dir_, cfg_, store).ok());
  }

  // Runs generate --json; the parsed object, or null JSON when it failed.
  nlohmann::json generate(const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--model",          dir_, "--prompt-ids", "3,9,4,20", "--json",
                                     "--max-new-tokens", "7"};
    args.insert(args.end(), extra.begin(), extra.end());
    ::testing::internal::CaptureStdout();
    const int rc = run(args);
    const std::string out = ::testing::internal::GetCapturedStdout();
    if (rc != 0) return nullptr;
    return nlohmann::json::parse(out);
  }

  // log p(ids[i] | prompt, ids[<i]) from the full forward at depth T.
  std::vector<double> oracle(const std::vector<int>& prompt, const std::vector<int>& ids, int T) {
    auto ck = load_checkpoint(dir_);
    EXPECT_TRUE(ck.ok()) << ck.status();
    const Weights w = bind_weights(ck->config, ck->params);
    std::vector<int> seq = prompt;
    seq.insert(seq.end(), ids.begin(), ids.end());
    const std::vector<float> logits = full_forward(ck->config, w, seq, T);
    const size_t V = size_t(ck->config.vocab_size);
    std::vector<double> lp;
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto row = std::span<const float>(logits).subspan((prompt.size() - 1 + i) * V, V);
      lp.push_back(testing_ref::log_softmax(row, ids[i]));
    }
    return lp;
  }

  ModelConfig cfg_;
  std::string dir_;
};

// --json reports the engine's usage and timing as `cemlm client generate --json` does, so a
// script can time decoding without process start and model load in it.
TEST_F(GenerateCli, JsonReportsUsageAndTiming) {
  const nlohmann::json j = generate({"--recursion", "3", "--temperature", "0"});
  ASSERT_FALSE(j.is_null());
  const nlohmann::json& u = j.at("usage");
  EXPECT_EQ(u["prompt_tokens"], 4);
  EXPECT_EQ(u["generated_tokens"], 7);
  // Every token run through the model (the prompt and all but the last generated one) at T = 3
  // through each layer's two CEM sub-layers.
  EXPECT_EQ(u["recursion_steps"], int64_t(4 + 7 - 1) * 3 * 2 * cfg_.n_layers);
  EXPECT_EQ(u["cached_prompt_tokens"], 0);
  const nlohmann::json& t = j.at("timing");
  const double queue = t["queue_seconds"], first = t["first_token_seconds"], e2e = t["e2e_seconds"];
  EXPECT_GE(queue, 0.0);
  EXPECT_GE(first, queue);
  EXPECT_GT(e2e, first);  // six more tokens came after the first
}

TEST_F(GenerateCli, JsonLogprobsAreTheModelsAtEachDepth) {
  for (const char* T : {"1", "3"}) {
    const nlohmann::json j = generate({"--recursion", T, "--temperature", "0.9", "--seed", "11"});
    ASSERT_FALSE(j.is_null()) << "T=" << T;
    const std::vector<int> ids = j["ids"];
    const std::vector<double> lp = j["logprobs"];
    ASSERT_EQ(ids.size(), 7u);
    ASSERT_EQ(lp.size(), 7u);
    EXPECT_EQ(j["finish_reason"], "length");
    EXPECT_TRUE(j["text"].is_string());
    const std::vector<double> want = oracle({3, 9, 4, 20}, ids, std::stoi(T));
    for (size_t i = 0; i < ids.size(); ++i)
      EXPECT_NEAR(lp[i], want[i], 1e-4) << "T=" << T << " token " << i;
  }
  // The same seed gives the same tokens; the model's default depth (2) is used without --recursion.
  const nlohmann::json a = generate({"--temperature", "0.9", "--seed", "5"});
  const nlohmann::json b = generate({"--temperature", "0.9", "--seed", "5"});
  ASSERT_FALSE(a.is_null());
  EXPECT_EQ(a["ids"], b["ids"]);
  const std::vector<double> lp = a["logprobs"];
  const std::vector<double> want = oracle({3, 9, 4, 20}, a["ids"].get<std::vector<int>>(), 2);
  for (size_t i = 0; i < lp.size(); ++i)
    EXPECT_NEAR(lp[i], want[i], 1e-4) << "default T, token " << i;
  EXPECT_EQ(a["seed"], 5);
  // Without --seed one is drawn and reported: passing it back gives the same sample.
  const nlohmann::json drawn = generate({"--temperature", "0.9"});
  ASSERT_FALSE(drawn.is_null());
  ASSERT_TRUE(drawn["seed"].is_number_unsigned());
  EXPECT_LT(drawn["seed"].get<uint64_t>(), uint64_t(1) << 53);  // exact in a double: jq keeps it
  const nlohmann::json replay = generate(
      {"--temperature", "0.9", "--seed", std::to_string(drawn["seed"].get<uint64_t>())});
  EXPECT_EQ(replay["ids"], drawn["ids"]);
}

// A bf16 or int8 cache, bf16 or int8 weights, bf16 or int8 weights and inputs (--device cpu:bf16 /
// cpu:int8 / cpu:bf16dot / cpu:int8dot): logprobs near the fp32 model's, and not equal to them (the
// flag reached the runner). The tests against the oracle on rounded weights are in
// engine_real_test.cc.
TEST_F(GenerateCli, LowPrecisionCacheAndWeightsStayCloseToTheModel) {
  std::vector<std::vector<std::string>> cases = {{"--kv-cache-dtype", "bf16"},
                                                 {"--kv-cache-dtype", "int8"}};
  if (packed_weights_available())  // else refused: see LowPrecisionWeights… in engine_real_test
    cases.insert(cases.end(), {{"--device", "cpu:bf16"}, {"--device", "cpu:int8"}});
  if (bf16_dot_available()) cases.push_back({"--device", "cpu:bf16dot"});
  if (int8_dot_available()) cases.push_back({"--device", "cpu:int8dot"});
  for (const std::vector<std::string>& flags : cases) {
    std::vector<std::string> args = {"--temperature", "0"};
    args.insert(args.end(), flags.begin(), flags.end());
    const nlohmann::json j = generate(args);
    ASSERT_FALSE(j.is_null()) << flags[1];
    const std::vector<double> lp = j["logprobs"];
    const std::vector<double> want = oracle({3, 9, 4, 20}, j["ids"].get<std::vector<int>>(), 2);
    double off = 0;
    for (size_t i = 0; i < lp.size(); ++i) {
      EXPECT_NEAR(lp[i], want[i], 3e-2) << flags[1] << " token " << i;
      off = std::max(off, std::fabs(lp[i] - want[i]));
    }
    EXPECT_GT(off, 0.0) << flags[1] << " changed nothing";
  }
}

TEST_F(GenerateCli, BadFlagsFailNamingTheFlag) {
  struct Bad {
    std::vector<std::string> args;
    std::string message;
    int status = 0;  // the exit status, where the case checks it
  };
  const std::vector<Bad> bad = {
      {{"--kv-cache-dtype", "fp8"}, "--kv-cache-dtype \"fp8\" is not one of fp32, bf16, int8", 2},
      {{"--device", "cpu:int4"}, "--device \"cpu:int4\" is not one of cpu, cpu:fp32, cpu:bf16", 2},
      {{"--threads", "-2"}, "--threads -2 must be >= 0", 2},
      // Past the system's thread limit, libgomp's thread creation failed and ended the process.
      {{"--threads", "100000"}, "--threads 100000 must be >= 0 and at most 1024", 2},
      {{"--prompt", "hello"}, "give exactly one of --prompt and --prompt-ids"},
      {{"--seed", "-3"}, "--seed: expected an integer"},
      {{"--no-bos"}, "--no-bos applies to --prompt only"},
      {{"--recursion", "99"}, "--recursion = 99 exceeds the model's recursion.max = 8"},
      {{"--max-new-tokens", "9999"}, "--max-new-tokens"},
      {{"--top-p", "2"}, "--top-p"},
      // Printed with enough digits to differ from the bound it breaks.
      {{"--top-p", "1.0000001"}, "--top-p must be in (0, 1] (got 1.0000001)", 2},
      {{"--min-p", "1.5"}, "--min-p must be in [0, 1] (got 1.5)", 2},
      // Values a float cannot hold are quoted as typed: they were inf and 0 ("(got inf)").
      {{"--temperature", "1e39"},
       "option '--temperature': expected a decimal number like 0.5 that a float holds"},
      {{"--top-p", "1e-50"}, "smaller ones would round to 0), got '1e-50'"},
      // A flag where the value should be is not taken as the value.
      {{"--kv-cache-dtype", "--json"},
       "option '--kv-cache-dtype' needs a value, but '--json' follows it, an option of its own; "
       "for that text as the value write --kv-cache-dtype=--json"},
      {{"--repetition-penalty", "0"}, "--repetition-penalty must be in [0.01, 100]", 2},
      {{"--presence-penalty", "3"}, "--presence-penalty must be in [-2, 2] (got 3)"},
      {{"--frequency-penalty", "-2.5"}, "--frequency-penalty must be in [-2, 2] (got -2.5)"},
      {{"--top-logprobs", "21"}, "--top-logprobs must be in [0, 20] (got 21)", 2},
      {{"--stop-token-ids", "5,x"}, "--stop-token-ids: expected comma-separated integers"},
      // Judged with the model's vocabulary, not before it is known.
      {{"--stop-token-ids", "5,61"}, "--stop-token-ids[1] = 61 is not a token id in [0, 61)", 1},
      {{"--logit-bias", "61:1"}, "--logit-bias has the key 61, not a token id in [0, 61)", 1},
      {{"--stop", "ab"}, "--stop needs a tokenizer and this model has none"},
      {{"--min-new-tokens", "63"},
       // (that maximum is the room the prompt leaves: --max-new-tokens was not given)
       "--min-new-tokens = 63 is more than the 62 tokens generated at most with --max-new-tokens "
       "unset (the room the prompt leaves under max_seq_len = 64)"},
      {{"--logit-bias", "5"}, "--logit-bias: expected ID:BIAS pairs like 17:-100,42:2.5, got '5'"},
      {{"--logit-bias", "5:1,x:2"}, "--logit-bias: expected ID:BIAS pairs"},
      {{"--logit-bias", "5:200"}, "--logit-bias[5] must be in [-100, 100] (got 200)", 2},
      {{"--logit-bias", "61:1"}, "--logit-bias has the key 61, not a token id in [0, 61)"},
      // A usage error here as in `cemlm client generate` (the engine's refusal exited 1).
      {{"--logit-bias", "5:1,5:-100"}, "--logit-bias gives token 5 more than once", 2},
      {{"--kv-cache-memory", "12Q"}, "--kv-cache-memory: expected bytes like 4G"},
      {{"--kv-cache-memory", "0"}, "--kv-cache-memory 0 holds no KV cache: give its size"},
      {{"--kv-cache-memory", "999999999999999T"}, "--kv-cache-memory: expected bytes like 4G"},
      // The engine's error names a flag this command has.
      {{"--kv-cache-memory", "1K"},
       "a KV cache of 1024 bytes holds 0 blocks of 16 tokens, but one sequence of the model's "
       "max_seq_len (64) needs 4 ("},
  };
  for (const Bad& b : bad) {
    std::vector<std::string> args = {"--model", dir_, "--prompt-ids", "3,9", "--json"};
    args.insert(args.end(), b.args.begin(), b.args.end());
    ::testing::internal::CaptureStderr();
    const int rc = run(args);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(rc, 0) << b.args[0];
    if (b.status != 0) {
      EXPECT_EQ(rc, b.status) << b.args[0];
    }
    EXPECT_NE(err.find(b.message), std::string::npos) << b.args[0] << ": " << err;
  }
}

// What is wrong whatever the model is, is refused before the model loads, as a usage error:
// here there is no model at all, and the flag's own error comes first.
TEST_F(GenerateCli, FlagsWrongForAnyModelAreRefusedBeforeItLoads) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"--prompt-ids", "3,,4"}, "--prompt-ids: expected comma-separated integers"},
      {{"--temperature", "-1"}, "--temperature must be a finite number >= 0"},
      {{"--max-new-tokens", "0"}, "--max-new-tokens must be >= 1 (got 0)"},
      {{"--threads", "-1"}, "--threads -1 must be >= 0"},
      {{"--device", "gpu"}, "--device \"gpu\" is not one of"},
      {{"--stop", ""}, "--stop[0] is empty"},
      {{"--seed", "-1"}, "--seed: expected an integer"},
      {{"--prompt-ids", "3,-1"}, "--prompt-ids[1] = -1 is not a token id (ids are >= 0)"},
      // No model has a negative id: the same usage error for every list of ids.
      {{"--stop-token-ids", "-1"}, "--stop-token-ids[0] = -1 is not a token id (ids are >= 0)"},
      {{"--logit-bias", "-1:1"}, "--logit-bias has the key -1, not a token id (ids are >= 0)"},
      {{"--recursion", "-1"}, "--recursion = -1 must be >= 0"},
      {{"--prompt", "ab\xff"}, "--prompt is not valid UTF-8 (bad byte at offset 2)"},
      // Past the default's 64 while --max-new-tokens is unset: too many for any model.
      {{"--min-new-tokens", "100"},
       "--min-new-tokens = 100 is more than the 64 tokens generated at most with "
       "--max-new-tokens unset (its default)"},
  };
  for (const auto& [flags, message] : bad) {
    std::vector<std::string> args = {"--model", dir_ + "/no-such-model", "--json"};
    if (flags[0] != "--prompt-ids" && flags[0] != "--prompt")
      args.insert(args.end(), {"--prompt-ids", "3"});
    args.insert(args.end(), flags.begin(), flags.end());
    ::testing::internal::CaptureStderr();
    const int rc = run(args);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(rc, 2) << flags[0] << ": " << err;
    EXPECT_NE(err.find(message), std::string::npos) << flags[0] << ": " << err;
    EXPECT_EQ(err.find("no-such-model"), std::string::npos) << flags[0] << ": " << err;
  }
}

// So does `cemlm score` a --text that is not UTF-8 (it loaded the model first, then exited 1).
TEST_F(GenerateCli, ScoreRefusesATextNotUtf8BeforeTheModelLoads) {
  std::vector<std::string> args = {"--model", dir_ + "/no-such-model", "--text", "caf\xE9!"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStderr();
  const int rc = cli::cmd_score(int(argv.size()), argv.data());
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 2) << err;
  EXPECT_NE(err.find("--text is not valid UTF-8 (bad byte at offset 3)"), std::string::npos) << err;
  EXPECT_EQ(err.find("no-such-model"), std::string::npos) << err;
}

// What `cemlm score` cannot score names the flag it came from; an empty --text, or one id, is a
// usage error before the model loads, as `cemlm client score` refuses them (they exited 1 with
// "need at least 2 tokens to score", which named no flag).
TEST_F(GenerateCli, ScoreRefusesTooFewOrTooManyTokensNamingTheFlag) {
  std::string sixty_five = "3";
  for (int i = 1; i < 65; ++i) sixty_five += ",3";
  const struct {
    std::vector<std::string> args;
    std::string message;
    int rc;
  } cases[] = {
      {{"--model", dir_ + "/no-such-model", "--text", ""},
       "--text is empty; give a text to score, or its ids as --ids",
       2},
      {{"--model", dir_ + "/no-such-model", "--ids", "7"},
       "--ids: need at least 2 tokens to score (got 1)",
       2},
      {{"--model", dir_, "--ids", sixty_five},
       "--ids has 65 tokens; the model's max_seq_len is 64: give fewer ids",
       1},
      {{"--model", dir_, "--ids", "3,61"}, "--ids[1] = 61 is not a token id in [0, 61)", 1},
      {{"--model", dir_ + "/no-such-model", "--ids", "3,4", "--threads", "-1"},
       "--threads -1 must be >= 0 and at most 1024",
       2},
  };
  for (auto c : cases) {
    std::vector<char*> argv;
    for (std::string& a : c.args) argv.push_back(a.data());
    ::testing::internal::CaptureStdout();
    ::testing::internal::CaptureStderr();
    const int rc = cli::cmd_score(int(argv.size()), argv.data());
    const std::string out = ::testing::internal::GetCapturedStdout();
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(rc, c.rc) << c.message << ": " << err;
    EXPECT_EQ(out, "");
    EXPECT_NE(err.find(c.message), std::string::npos) << err;
  }
}

// --dump-logits naming a file of another checkpoint is refused before the forward: written, it
// replaced that checkpoint's weights with logits, and it no longer loaded.
TEST_F(GenerateCli, ScoreDumpRefusesAnotherCheckpointsFile) {
  const std::string other = testing_temp::fresh_dir("score_dump_other");
  ParamStore store(cfg_);
  testing_models::randomize(store, 4);
  ASSERT_TRUE(save_checkpoint(other, cfg_, store).ok());
  const std::string target = other + "/model.safetensors";
  std::vector<std::string> args = {"--model", dir_, "--ids", "3,9,4", "--dump-logits", target};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int rc = cli::cmd_score(int(argv.size()), argv.data());
  ::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("--dump-logits '" + target + "' is a file of the checkpoint"),
            std::string::npos)
      << err;
  EXPECT_TRUE(load_checkpoint(other).ok());
}

// `cemlm score` refuses a perplexity past a double's range, as the server's Score does: with the
// head's weights ×1e30 the mean negative log-likelihood is ~1e30, and the perplexity was printed
// as null (JSON has no inf) with exit 0.
TEST_F(GenerateCli, ScoreRefusesAPerplexityPastItsRange) {
  ParamStore store(cfg_);
  testing_models::randomize(store, 3);
  const Tensor head = store.get("lm_head.weight");
  for (int64_t i = 0; i < head.numel(); ++i) head.data[i] *= 1e30f;
  const std::string dir = testing_temp::fresh_dir("score_overflow");
  ASSERT_TRUE(save_checkpoint(dir, cfg_, store).ok());
  std::vector<std::string> args = {"--model", dir, "--ids", "3,9,4,20"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int rc = cli::cmd_score(int(argv.size()), argv.data());
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 1) << out;
  EXPECT_EQ(out, "");
  EXPECT_NE(err.find(") overflows: the model gives the text almost no probability"),
            std::string::npos)
      << err;
}

// Without a tokenizer the tokens have no text: streamed, they printed an empty line (exit 0), so a
// first run on a random-init checkpoint seemed to generate nothing. Now it says to add --json.
TEST_F(GenerateCli, StreamingFromAModelWithoutTokenizerSaysToUseJson) {
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  const int rc = run({"--model", dir_, "--prompt-ids", "3,9", "--max-new-tokens", "3"});
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 1);
  EXPECT_EQ(out, "");
  EXPECT_NE(err.find("has no tokenizer.model, so its tokens have no text to stream; add --json"),
            std::string::npos)
      << err;
  EXPECT_FALSE(generate({"--temperature", "0"}).is_null());  // with --json: the ids
}

TEST_F(GenerateCli, KvCacheMemoryIsUsed) {
  // Enough for one max_seq_len sequence (64 tokens) but not for the 1K above: the flag reaches
  // the engine; and the error for too little names this command's flag.
  ASSERT_FALSE(generate({"--temperature", "0", "--kv-cache-memory", "1M"}).is_null());
  std::vector<std::string> args = {"--model", dir_, "--prompt-ids", "3,9", "--kv-cache-memory",
                                   "2KB"};
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run(args), 1);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("a KV cache of 2048 bytes holds 0 blocks"), std::string::npos) << err;
  EXPECT_NE(err.find("raise --kv-cache-memory"), std::string::npos) << err;
  // Said from config.json, before the weights are read (a large checkpoint loaded for seconds
  // first): a directory of the config alone gets the same answer.
  const std::string config_only = testing_temp::fresh_dir("config_only") + "/model";
  std::filesystem::create_directories(config_only);
  std::filesystem::copy_file(dir_ + "/config.json", config_only + "/config.json");
  args[1] = config_only;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run(args), 1);
  const std::string early = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(early.find("a KV cache of 2048 bytes holds 0 blocks"), std::string::npos) << early;
}

// The default --max-new-tokens (64) is capped to the room the prompt leaves in max_seq_len (64
// here), so a plain `generate` works on a small model; a value given is checked as given.
TEST_F(GenerateCli, DefaultMaxNewTokensFitsTheModel) {
  ASSERT_EQ(cfg_.max_seq_len, 64);
  auto generate_without_max = [&](const std::string& prompt_ids, std::string* err) {
    std::vector<std::string> args = {"--model",       dir_, "--prompt-ids", prompt_ids, "--json",
                                     "--temperature", "0"};
    ::testing::internal::CaptureStdout();
    ::testing::internal::CaptureStderr();
    const int rc = run(args);
    const std::string out = ::testing::internal::GetCapturedStdout();
    *err = ::testing::internal::GetCapturedStderr();
    return rc == 0 ? nlohmann::json::parse(out) : nlohmann::json();
  };
  std::string err;
  const nlohmann::json j = generate_without_max("3,9,4", &err);
  ASSERT_FALSE(j.is_null()) << err;
  EXPECT_EQ(j["ids"].size(), 61u);
  EXPECT_EQ(j["finish_reason"], "length");
  std::string full = "3";
  for (int i = 1; i < 64; ++i) full += ",3";
  EXPECT_TRUE(generate_without_max(full, &err).is_null());  // no room: an error on the prompt
  EXPECT_NE(err.find("--prompt-ids has 64 tokens: the model's max_seq_len = 64 leaves no room"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("--max-new-tokens"), std::string::npos) << "a flag not given: " << err;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run({"--model", dir_, "--prompt-ids", "3,9,4", "--max-new-tokens", "64", "--json"}), 1);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("--prompt-ids (3 tokens) + --max-new-tokens (64) = 67 exceeds"),
            std::string::npos)
      << err;
}

TEST_F(GenerateCli, StopTokenIdsPenaltiesAndTopLogprobs) {
  const nlohmann::json base = generate({"--temperature", "0"});
  ASSERT_FALSE(base.is_null());
  const std::vector<int> ids = base["ids"];
  ASSERT_EQ(ids.size(), 7u);
  // Greedy: a stop id ends the output at its first occurrence (the id itself included).
  size_t k = 2;
  while (k > 0 && std::find(ids.begin(), ids.begin() + long(k), ids[k]) != ids.begin() + long(k))
    --k;
  const std::string stop_id = std::to_string(ids[k]);
  const nlohmann::json stopped =
      generate({"--temperature", "0", "--stop-token-ids", stop_id + "," + stop_id});
  ASSERT_FALSE(stopped.is_null());
  const std::vector<int> got = stopped["ids"];
  EXPECT_EQ(got, std::vector<int>(ids.begin(), ids.begin() + long(k) + 1));
  EXPECT_EQ(stopped["finish_reason"], "stop");

  // Top logprobs: K alternatives per token, best first; greedy picks the best one.
  const nlohmann::json tops = generate({"--temperature", "0", "--top-logprobs", "3"});
  ASSERT_FALSE(tops.is_null());
  ASSERT_EQ(tops["top_logprobs"].size(), 7u) << tops.dump();
  for (size_t i = 0; i < 7; ++i) {
    const nlohmann::json& alts = tops["top_logprobs"][i];
    ASSERT_EQ(alts.size(), 3u);
    EXPECT_EQ(alts[0]["id"], ids[i]);
    EXPECT_NEAR(alts[0]["logprob"].get<double>(), tops["logprobs"][i].get<double>(), 1e-5);
    EXPECT_GE(alts[0]["logprob"].get<double>(), alts[1]["logprob"].get<double>());
  }
  EXPECT_FALSE(base.contains("top_logprobs"));
  // Without --json there is nowhere to put them: a usage error (2, as the flag parser's).
  std::vector<std::string> args = {"--model", dir_, "--prompt-ids", "3,9", "--top-logprobs", "2"};
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run(args), 2);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("--top-logprobs needs --json"),
            std::string::npos);

  // The penalty and min-p flags reach the engine (out-of-range values fail there, see
  // BadFlagsFailNamingTheFlag); the logprobs stay those of the unmodified model.
  const nlohmann::json pen = generate({"--temperature", "0", "--repetition-penalty", "100",
                                       "--presence-penalty", "2", "--frequency-penalty", "2",
                                       "--min-p", "0.05", "--ignore-eos"});
  ASSERT_FALSE(pen.is_null());
  const std::vector<int> pen_ids = pen["ids"];
  ASSERT_EQ(pen_ids.size(), 7u);
  const std::vector<double> want = oracle({3, 9, 4, 20}, pen_ids, 2);
  for (size_t i = 0; i < pen_ids.size(); ++i)
    EXPECT_NEAR(pen["logprobs"][i].get<double>(), want[i], 1e-4) << "token " << i;
}

// --min-new-tokens keeps the stop ids out of the first tokens; --logit-bias moves the draw. Both
// reach the engine through the flags, and the logprobs stay the unmodified model's.
TEST_F(GenerateCli, MinNewTokensAndLogitBias) {
  const nlohmann::json base = generate({"--temperature", "0"});
  ASSERT_FALSE(base.is_null());
  const std::vector<int> ids = base["ids"];
  const std::string first = std::to_string(ids[0]);
  // Stopping on the first greedy token: one token; with --min-new-tokens 3, at least 3, none of
  // the first 3 that token.
  const nlohmann::json one = generate({"--temperature", "0", "--stop-token-ids", first});
  ASSERT_FALSE(one.is_null());
  EXPECT_EQ(one["ids"].size(), 1u);
  const nlohmann::json held =
      generate({"--temperature", "0", "--stop-token-ids", first, "--min-new-tokens", "3"});
  ASSERT_FALSE(held.is_null());
  const std::vector<int> held_ids = held["ids"];
  ASSERT_GE(held_ids.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(held_ids[i], ids[0]) << "token " << i;
  if (held_ids.size() < 7) {  // a stop, from the 4th token on
    EXPECT_EQ(held_ids.back(), ids[0]);
  }
  std::vector<double> want = oracle({3, 9, 4, 20}, held_ids, 2);
  for (size_t i = 0; i < held_ids.size(); ++i)
    EXPECT_NEAR(held["logprobs"][i].get<double>(), want[i], 1e-4) << "token " << i;
  // A bias of 100 on a token the model never picked makes every greedy token that one.
  int forced = 0;
  while (std::find(ids.begin(), ids.end(), forced) != ids.end()) ++forced;
  const nlohmann::json biased =
      generate({"--temperature", "0", "--logit-bias", std::to_string(forced) + ":100"});
  ASSERT_FALSE(biased.is_null());
  const std::vector<int> biased_ids = biased["ids"];
  EXPECT_EQ(biased_ids, std::vector<int>(7, forced));
  want = oracle({3, 9, 4, 20}, biased_ids, 2);
  for (size_t i = 0; i < biased_ids.size(); ++i)
    EXPECT_NEAR(biased["logprobs"][i].get<double>(), want[i], 1e-4) << "token " << i;
}

// A checkpoint with a byte-fallback tokenizer: stop strings, and streamed text that must come
// out byte for byte (a byte piece can decode to NUL).
class GenerateCliText : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_files::fresh_temp_dir();
    TokenizerTrainOptions o;
    o.inputs = testing_files::small_corpus();
    o.vocab_size = 400;
    o.out_path = dir_ + "/tok.model";
    std::string error;
    ASSERT_TRUE(train_tokenizer(o, &error, nullptr)) << error;
    ModelConfig cfg = testing_models::make_config(testing_models::all_variants()[2], 400);
    cfg.eos_id = -1;
    ParamStore store(cfg);
    testing_models::randomize(store, 7);
    ckpt_ = dir_ + "/ckpt";
    ASSERT_TRUE(save_checkpoint(ckpt_, cfg, store, o.out_path).ok());
  }

  // Runs generate; stdout, or "" with *rc set.
  std::string output(std::vector<std::string> extra, int* rc) {
    std::vector<std::string> args = {"--model", ckpt_, "--prompt-ids", "5,70,9,200"};
    args.insert(args.end(), extra.begin(), extra.end());
    ::testing::internal::CaptureStdout();
    *rc = run(args);
    return ::testing::internal::GetCapturedStdout();
  }

  std::string dir_, ckpt_;
};

// A tokenizer with more pieces than the model has ids is refused when the model loads, not
// blamed on a prompt that happens to encode to a large id; and before its weights are read, or
// the tokenizer itself loaded (its pieces are counted in the file: a 72 MB one took 1.8 GB and
// 21 s to be refused), so a broken weights file is not the error.
TEST_F(GenerateCliText, TokenizerLargerThanTheVocabularyIsRefusedAtLoad) {
  ModelConfig cfg = testing_models::make_config(testing_models::all_variants()[2], 300);
  ParamStore store(cfg);
  testing_models::randomize(store, 7);
  ckpt_ = dir_ + "/small_vocab";
  ASSERT_TRUE(save_checkpoint(ckpt_, cfg, store, dir_ + "/tok.model").ok());
  std::filesystem::resize_file(ckpt_ + "/model.safetensors", 100);
  int rc = 0;
  ::testing::internal::CaptureStderr();
  output({"--max-new-tokens", "2"}, &rc);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("tokenizer '" + ckpt_ +
                     "/tokenizer.model': the tokenizer has 400 pieces but the model's "
                     "vocab_size is 300"),
            std::string::npos)
      << err;
}

// A text prompt's errors count its tokens with the BOS the command puts first, and say so.
TEST_F(GenerateCliText, ErrorsOnATextPromptSayTheCountIncludesBos) {
  std::string err;
  for (const bool no_bos : {false, true}) {
    std::vector<std::string> args = {"--model", ckpt_, "--prompt", "the cat sat",
                                     "--max-new-tokens", "64"};
    if (no_bos) args.push_back("--no-bos");
    ::testing::internal::CaptureStderr();
    EXPECT_EQ(run(args), 1);
    err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find(no_bos ? "--prompt (as tokens: " : "--prompt (as tokens, BOS included: "),
              std::string::npos)
        << err;
  }
}

// An empty --prompt without its BOS is nothing to generate from: a usage error before the model
// loads, as `cemlm client generate` refuses it (it exited 1, after the load). Score's too few
// tokens of a text say that they are its tokens.
TEST_F(GenerateCliText, TooShortATextIsRefusedNamingTheFlag) {
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run({"--model", ckpt_ + "/missing", "--prompt", "", "--no-bos"}), 2);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("--prompt is empty and --no-bos leaves out the BOS: nothing to generate from"),
            std::string::npos)
      << err;
  std::string error;
  const auto tok = Tokenizer::load(ckpt_ + "/tokenizer.model", &error);
  ASSERT_TRUE(tok) << error;
  ASSERT_EQ(tok->encode("a", &error)->size(), 1u);  // the whole text is one piece
  std::vector<std::string> args = {"--model", ckpt_, "--text", "a", "--no-bos"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(cli::cmd_score(int(argv.size()), argv.data()), 1);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("--text (as tokens) has 1 token; need at least 2 to score"), std::string::npos)
      << err;
}

TEST_F(GenerateCliText, StreamedTextKeepsNulBytes) {
  // Near-uniform sampling over 400 ids (4 + 0 is the <0x00> byte piece): find a seed whose text
  // has a NUL, then the streamed text must equal the --json text byte for byte.
  int found = -1;
  std::string text;
  for (int seed = 0; seed < 200 && found < 0; ++seed) {
    int rc = 0;
    const std::string out = output({"--temperature", "1000", "--max-new-tokens", "56", "--seed",
                                    std::to_string(seed), "--json"}, &rc);
    ASSERT_EQ(rc, 0);
    text = nlohmann::json::parse(out)["text"];
    if (text.find('\0') != std::string::npos) found = seed;
  }
  ASSERT_GE(found, 0) << "no seed sampled the <0x00> piece";
  int rc = 0;
  const std::string streamed = output(
      {"--temperature", "1000", "--max-new-tokens", "56", "--seed", std::to_string(found)}, &rc);
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(streamed, text + "\n");
}

// Streamed (no --json), a drawn seed is reported on stderr, and passing it back gives the same
// text; greedy decoding, which draws nothing, reports none.
TEST_F(GenerateCliText, StreamedSampleReportsItsDrawnSeed) {
  const std::vector<std::string> sample = {"--temperature", "2", "--max-new-tokens", "24"};
  int rc = 0;
  ::testing::internal::CaptureStderr();
  const std::string text = output(sample, &rc);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(rc, 0) << err;
  unsigned long long seed = 0;
  ASSERT_EQ(std::sscanf(err.c_str(), "seed %llu (--seed", &seed), 1) << err;
  EXPECT_NE(err.find("--seed " + std::to_string(seed) + " makes this sample again"),
            std::string::npos)
      << err;
  std::vector<std::string> again = sample;
  again.insert(again.end(), {"--seed", std::to_string(seed)});
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(output(again, &rc), text);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");  // given, not drawn: nothing to report
  ::testing::internal::CaptureStderr();
  output({"--temperature", "0", "--max-new-tokens", "4"}, &rc);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ::testing::internal::CaptureStderr();  // below 1e-5 is greedy too
  output({"--temperature", "5e-6", "--max-new-tokens", "4"}, &rc);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST_F(GenerateCliText, StopStringsCutTheText) {
  const std::vector<std::string> common = {"--temperature", "3", "--max-new-tokens", "40",
                                           "--seed", "4", "--json"};
  int rc = 0;
  const nlohmann::json base = nlohmann::json::parse(output(common, &rc));
  ASSERT_EQ(rc, 0);
  const std::string text = base["text"];
  // The first ASCII letter after the start: the output stops just before its first occurrence.
  size_t at = 1;
  while (at < text.size() && !std::isalpha(static_cast<unsigned char>(text[at]))) ++at;
  ASSERT_LT(at, text.size()) << text;
  const std::string stop(1, text[at]);
  std::vector<std::string> args = common;
  for (const std::string& s : {std::string("\x01never"), stop, std::string("zzzzzz")}) {
    args.push_back("--stop");
    args.push_back(s);
  }
  const nlohmann::json cut = nlohmann::json::parse(output(args, &rc));
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(cut["text"], text.substr(0, text.find(stop))) << "stop '" << stop << "'";
  EXPECT_EQ(cut["finish_reason"], "stop");
  // An empty stop string is refused, naming the flag, as a usage error.
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(output({"--stop", ""}, &rc), "");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("--stop[0] is empty"), std::string::npos);
  // Values beginning with "--" that read as no option are stop strings ("-- Larry Wall" ends
  // fortunes); they were refused as "needs at least one value". One that reads as an option is
  // refused with how to pass it.
  args = common;
  args.insert(args.end(), {"--stop", "--", "-- Larry Wall"});
  const nlohmann::json dashes = nlohmann::json::parse(output(args, &rc));
  ASSERT_EQ(rc, 0);
  EXPECT_EQ(dashes["text"], text.substr(0, text.find("--")));
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(output({"--stop", "--ab"}, &rc), "");
  EXPECT_EQ(rc, 2);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("write --stop=--ab"), std::string::npos);
}

// With a tokenizer that drops a text-initial space (spm_train's default), the generated text is
// what the ids add to the prompt's: a first piece "▁word" keeps its space after the prompt.
TEST_F(GenerateCliText, TextContinuesThePromptWithADummyPrefixTokenizer) {
  std::string bytes, error;
  ASSERT_TRUE(read_file(dir_ + "/tok.model", &bytes, &error)) << error;
  testing_files::write_file(dir_ + "/dummy.model", testing_files::with_dummy_prefix(bytes));
  const auto tok = Tokenizer::load(dir_ + "/dummy.model", &error);
  ASSERT_NE(tok, nullptr) << error;
  ASSERT_TRUE(tok->drops_leading_space());
  ModelConfig cfg = testing_models::make_config(testing_models::all_variants()[2], 400);
  cfg.eos_id = -1;
  ParamStore store(cfg);
  testing_models::randomize(store, 7);
  ckpt_ = dir_ + "/dummy_ckpt";
  ASSERT_TRUE(save_checkpoint(ckpt_, cfg, store, dir_ + "/dummy.model").ok());
  const std::vector<int> prompt = encode_input(*tok, "the cat", tok->bos_id(), &error).value();
  int spaced_first = 0;
  for (int seed = 0; seed < 12; ++seed) {
    std::vector<std::string> args = {"--model", ckpt_, "--prompt", "the cat", "--json",
                                     "--temperature", "1000", "--max-new-tokens", "12",
                                     "--seed", std::to_string(seed)};
    ::testing::internal::CaptureStdout();
    ASSERT_EQ(run(args), 0);
    const nlohmann::json j = nlohmann::json::parse(::testing::internal::GetCapturedStdout());
    const std::vector<int> ids = j["ids"];
    std::vector<int> all = prompt;
    all.insert(all.end(), ids.begin(), ids.end());
    EXPECT_EQ(j["text"], tok->decode(all).substr(tok->decode(prompt).size())) << "seed " << seed;
    spaced_first += tok->id_to_piece(ids.at(0)).starts_with("\u2581");
  }
  EXPECT_GT(spaced_first, 0) << "no seed began with a \"▁\" piece";
}

}  // namespace
}  // namespace cemlm
