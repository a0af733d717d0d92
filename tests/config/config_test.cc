// config.json parsing (MODEL.md §7): defaults, and each kind of bad input named by key.
#include <gtest/gtest.h>

#include "cemlm/engine/config.h"
#include "cemlm/engine/params.h"
#include "nlohmann/json.hpp"

namespace cemlm {
namespace {

nlohmann::json base() {
  return nlohmann::json::parse(R"({
    "architecture": "cemlm", "format_version": 1,
    "vocab_size": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "head_dim": 64, "d_ff": 768,
    "max_seq_len": 1024, "norm_eps": 1e-5, "rope_theta": 10000.0,
    "embedding": { "type": "lev", "tie_output": false,
                   "lev": { "digits": 3, "seed_dim": 32, "knots": 16, "rank": 16, "heads": 4 } },
    "attention": { "type": "cem", "diag": "shared", "precond_rank": 8 },
    "mlp":       { "type": "cem", "precond_rank": 8 },
    "recursion": { "default": 2, "max": 8, "step_size": "inverse_T" },
    "bos_id": 1, "eos_id": 2 })");
}

std::string error_of(const nlohmann::json& j) {
  auto c = parse_config(j.dump());
  EXPECT_FALSE(c.ok()) << j.dump();
  return c.ok() ? "" : std::string(c.status().message());
}

TEST(Config, SpecExampleParses) {
  auto c = parse_config(base().dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->lev.base, 16);  // 16^3 = 4096
  EXPECT_EQ(c->diag, DiagMode::kShared);
  EXPECT_EQ(c->recursion_default, 2);
  EXPECT_EQ(c->kv_floats_per_token_layer(), 256 + 256);
  auto again = parse_config(config_to_json(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(config_to_json(*again), config_to_json(*c));
}

TEST(Config, DefaultsApply) {
  auto j = base();
  j.erase("max_seq_len");
  j.erase("recursion");
  j["attention"].erase("diag");
  auto c = parse_config(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_seq_len, 2048);
  EXPECT_EQ(c->recursion_default, 1);
  EXPECT_EQ(c->recursion_max, 8);
  EXPECT_EQ(c->diag, DiagMode::kNone);
}

TEST(Config, ErrorsNameTheKey) {
  auto j = base();
  j["bogus"] = 1;
  EXPECT_NE(error_of(j).find("bogus"), std::string::npos);
}

}  // namespace
}  // namespace cemlm
