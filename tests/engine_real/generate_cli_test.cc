// `cemlm generate` through its entry point on a random-init checkpoint: the --json object's ids
// and logprobs (each the log-probability of ids[i] under the unmodified model, checked against
// the full-sequence forward), the KV-cache dtype flag, and the errors that name a bad flag.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "cemlm/cli/commands.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/cpu_model.h"
#include "cemlm/engine/sampler.h"
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
    dir_ = ::testing::TempDir() + "/generate_cli_" + std::to_string(getpid());
    ASSERT_TRUE(save_checkpoint(dir_, cfg_, store).ok());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

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
      lp.push_back(double(row[size_t(ids[i])]) - log_sum_exp(row));
    }
    return lp;
  }

  ModelConfig cfg_;
  std::string dir_;
};

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
  const nlohmann::json replay = generate(
      {"--temperature", "0.9", "--seed", std::to_string(drawn["seed"].get<uint64_t>())});
  EXPECT_EQ(replay["ids"], drawn["ids"]);
}

TEST_F(GenerateCli, Bf16CacheStaysCloseToTheModel) {
  const nlohmann::json j = generate({"--temperature", "0", "--kv-cache-dtype", "bf16"});
  ASSERT_FALSE(j.is_null());
  const std::vector<double> lp = j["logprobs"];
  const std::vector<double> want = oracle({3, 9, 4, 20}, j["ids"].get<std::vector<int>>(), 2);
  for (size_t i = 0; i < lp.size(); ++i) EXPECT_NEAR(lp[i], want[i], 3e-2) << "token " << i;
}

TEST_F(GenerateCli, BadFlagsFailNamingTheFlag) {
  struct Bad {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {{"--kv-cache-dtype", "fp8"}, "--kv-cache-dtype \"fp8\" is not one of fp32, bf16"},
      {{"--prompt", "hello"}, "give exactly one of --prompt and --prompt-ids"},
      {{"--seed", "-3"}, "--seed: expected an integer"},
      {{"--no-bos"}, "--no-bos applies to --prompt only"},
      {{"--recursion", "99"}, "--recursion = 99 exceeds the model's recursion.max = 8"},
      {{"--max-new-tokens", "9999"}, "--max-new-tokens"},
      {{"--top-p", "2"}, "--top-p"},
  };
  for (const Bad& b : bad) {
    std::vector<std::string> args = {"--model", dir_, "--prompt-ids", "3,9", "--json"};
    args.insert(args.end(), b.args.begin(), b.args.end());
    ::testing::internal::CaptureStderr();
    const int rc = run(args);
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(rc, 0) << b.args[0];
    EXPECT_NE(err.find(b.message), std::string::npos) << b.args[0] << ": " << err;
  }
}

}  // namespace
}  // namespace cemlm
