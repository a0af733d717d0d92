// config.json parsing (MODEL.md §7): defaults, and each kind of bad input named by key.
#include "cemlm/engine/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "cemlm/engine/params.h"
#include "cemlm/engine/strict_json.h"
#include "nlohmann/json.hpp"
#include "temp_dir.h"

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

// One bad config: `edit` breaks base(); the error must contain `key` (quoted as in the message).
struct BadConfig {
  std::string key;
  std::function<void(nlohmann::json&)> edit;
};

// "embedding.lev.digits" → JSON pointer "/embedding/lev/digits".
nlohmann::json::json_pointer pointer(std::string dotted) {
  std::replace(dotted.begin(), dotted.end(), '.', '/');
  return nlohmann::json::json_pointer("/" + dotted);
}
void set_path(nlohmann::json& j, const std::string& dotted, const nlohmann::json& value) {
  j[pointer(dotted)] = value;
}
void erase_path(nlohmann::json& j, const std::string& dotted) {
  const auto dot = dotted.rfind('.');
  nlohmann::json& parent = dot == std::string::npos ? j : j[pointer(dotted.substr(0, dot))];
  parent.erase(dot == std::string::npos ? dotted : dotted.substr(dot + 1));
}
BadConfig missing(const std::string& key) {
  return {key, [key](nlohmann::json& j) { erase_path(j, key); }};
}
BadConfig with(const std::string& key, nlohmann::json value) {
  return {key, [key, value](nlohmann::json& j) { set_path(j, key, value); }};
}
BadConfig with_all(const std::string& key, std::vector<std::pair<std::string, nlohmann::json>> kv) {
  return {key, [kv](nlohmann::json& j) {
            for (const auto& [k, v] : kv) set_path(j, k, v);
          }};
}

std::vector<BadConfig> bad_configs() {
  std::vector<BadConfig> v;
  for (const char* key : {"architecture",
                          "format_version",
                          "vocab_size",
                          "d_model",
                          "n_layers",
                          "n_heads",
                          "head_dim",
                          "d_ff",
                          "embedding",
                          "embedding.type",
                          "attention",
                          "attention.type",
                          "mlp",
                          "mlp.type",
                          "embedding.lev",
                          "embedding.lev.digits",
                          "embedding.lev.seed_dim",
                          "embedding.lev.knots",
                          "embedding.lev.rank",
                          "embedding.lev.heads"})
    v.push_back(missing(key));
  // Wrong types.
  v.push_back(with("architecture", 1));
  v.push_back(with("format_version", "1"));
  v.push_back(with("vocab_size", "4096"));
  v.push_back(with("d_model", 256.5));
  v.push_back(with("n_layers", true));
  v.push_back(with("max_seq_len", nullptr));
  v.push_back(with("norm_eps", "1e-5"));
  v.push_back(with("rope_theta", nlohmann::json::array({1})));
  v.push_back(with("embedding", "lev"));
  v.push_back(with("embedding.type", 1));
  v.push_back(with("embedding.tie_output", 0));
  v.push_back(with("embedding.lev", nlohmann::json::array()));
  v.push_back(with("embedding.lev.digits", 3.0));
  v.push_back(with("attention", nlohmann::json::array()));
  v.push_back(with("attention.diag", false));
  v.push_back(with("attention.precond_rank", "8"));
  v.push_back(with("mlp.type", nlohmann::json::object()));
  v.push_back(with("recursion", 2));
  v.push_back(with("recursion.default", 1.5));
  v.push_back(with("recursion.step_size", 1));
  v.push_back(with("bos_id", "1"));
  // Out of range / not one of the choices.
  v.push_back(with("architecture", "llama"));
  v.push_back(with("format_version", 2));
  v.push_back(with("vocab_size", 1));
  v.push_back(with("d_model", 0));
  v.push_back(with("n_layers", -1));
  v.push_back(with("n_heads", 0));
  v.push_back(with("head_dim", 0));
  v.push_back(with("d_ff", 0));
  v.push_back(with("max_seq_len", 0));
  v.push_back(with("norm_eps", 0.0));
  v.push_back(with("norm_eps", 2.0));
  v.push_back(with("rope_theta", -1.0));
  v.push_back(with("embedding.type", "onehot"));
  v.push_back(with("embedding.lev.digits", 0));
  v.push_back(with("embedding.lev.knots", 1));
  v.push_back(with("embedding.lev.heads", 0));
  v.push_back(with("attention.type", "linear"));
  v.push_back(with("attention.diag", "full"));
  v.push_back(with("attention.precond_rank", -1));
  v.push_back(with("attention.precond_rank", 257));  // > d_model
  v.push_back(with("mlp.type", "relu"));
  v.push_back(with("mlp.precond_rank", 1000));
  v.push_back(with("recursion.max", 0));
  v.push_back(with("recursion.max", 65));
  v.push_back(with("recursion.default", 0));
  v.push_back(with("recursion.step_size", "sqrt_T"));
  v.push_back(with("bos_id", 4096));  // == vocab_size
  v.push_back(with("eos_id", -2));
  // Unknown keys, top level and nested.
  v.push_back(with("bogus", 1));
  v.push_back(with("embedding.bogus", 1));
  v.push_back(with("embedding.lev.bogus", 1));
  v.push_back(with("attention.bogus", 1));
  v.push_back(with("mlp.bogus", 1));
  v.push_back(with("recursion.bogus", 1));
  // Rules between keys.
  v.push_back(with("head_dim", 63));
  v.push_back(
      with_all("attention.diag", {{"attention.type", "standard"}, {"attention.precond_rank", 0}}));
  v.push_back(with_all("attention.precond_rank",
                       {{"attention.type", "standard"}, {"attention.diag", "none"}}));
  v.push_back(with_all("mlp.precond_rank", {{"mlp.type", "swiglu"}}));
  v.push_back(with("embedding.tie_output", true));  // with lev
  v.push_back(with_all("embedding.lev", {{"embedding.type", "table"}}));
  v.push_back(with("recursion.default", 9));  // > recursion.max = 8
  v.push_back(with_all("recursion.default", {{"recursion.max", 2}, {"recursion.default", 3}}));
  return v;
}

// Values JSON holds but the model's types cannot: a positive float that rounds to 0 or to a
// subnormal in fp32, and an integer beyond int64 (which once read as -1).
TEST(Config, ValuesBeyondTheTypesAreRefusedAsGiven) {
  auto j = base();
  j["norm_eps"] = 1e-50;
  EXPECT_NE(error_of(j).find("'norm_eps' = 1e-50 is too small for a 32-bit float"),
            std::string::npos)
      << error_of(j);
  j["norm_eps"] = 1e-40;
  EXPECT_NE(error_of(j).find("'norm_eps' = 1e-40 is too small for a 32-bit float"),
            std::string::npos)
      << error_of(j);
  j["norm_eps"] = 1.2e-38;  // the smallest normal float is about 1.18e-38
  EXPECT_TRUE(parse_config(j.dump()).ok());
  j = base();
  j["rope_theta"] = 1e-50;
  EXPECT_NE(error_of(j).find("'rope_theta'"), std::string::npos);
  j = base();
  j["vocab_size"] = std::numeric_limits<uint64_t>::max();
  EXPECT_NE(error_of(j).find("'vocab_size' = 18446744073709551615 is out of range"),
            std::string::npos)
      << error_of(j);
  // Past 64 bits JSON's integers parse as floats: out of range too, not "must be an integer"; so
  // is a whole number out of range written as a float.
  for (const auto& [text, said] : std::vector<std::pair<std::string, std::string>>{
           {"1e23", "1e+23"},
           {"-1e23", "-1e+23"},
           {"18446744073709551616", "18446744073709551616"},
           {"3e9", "3e+09"}}) {
    std::string config = base().dump();
    config.replace(config.find("\"vocab_size\":4096"), 17, "\"vocab_size\":" + text);
    const auto parsed = parse_config(config);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_NE(parsed.status().message().find("'vocab_size' = " + said + " is out of range ["),
              std::string::npos)
        << parsed.status();
  }
  j["vocab_size"] = 4096.5;
  EXPECT_NE(error_of(j).find("'vocab_size' must be an integer"), std::string::npos) << error_of(j);
}

// A refused value is quoted as it reads back: with 6 digits, 1.0000001 read "= 1 is out of range
// (0, 1]".
TEST(Config, ARefusedNumberIsQuotedExactly) {
  auto j = base();
  j["norm_eps"] = 1.0000001;
  EXPECT_NE(error_of(j).find("'norm_eps' = 1.0000001 is out of range (0, 1]"), std::string::npos)
      << error_of(j);
  j = base();
  j["rope_theta"] = 1000000000000.5;
  EXPECT_NE(error_of(j).find("'rope_theta' = 1000000000000.5 is out of range"), std::string::npos)
      << error_of(j);
}

TEST(Config, EveryBadConfigIsRefusedNamingTheKey) {
  for (const BadConfig& b : bad_configs()) {
    auto j = base();
    b.edit(j);
    const std::string err = error_of(j);
    EXPECT_NE(err.find("'" + b.key + "'"), std::string::npos)
        << "key " << b.key << " not named in: " << err << "\nconfig: " << j.dump();
  }
}

TEST(Config, NotJsonIsRefused) {
  for (const char* text : {"", "{", "{\"architecture\": }", "not json at all"}) {
    auto c = parse_config(text);
    ASSERT_FALSE(c.ok()) << text;
    EXPECT_NE(c.status().message().find("JSON"), std::string::npos) << c.status().message();
  }
  auto c = parse_config("[1, 2]");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("top level"), std::string::npos) << c.status().message();
}

TEST(Config, CemOnlyKeysAtTheirDefaultsAreAllowedElsewhere) {
  auto j = base();
  j["attention"] = {{"type", "standard"}, {"diag", "none"}, {"precond_rank", 0}};
  j["mlp"] = {{"type", "swiglu"}, {"precond_rank", 0}};
  j["embedding"] = {{"type", "table"}, {"tie_output", true}};
  auto c = parse_config(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->tie_output);
}

TEST(Config, LoadConfigNamesTheFile) {
  auto c = load_config("/nonexistent/dir/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("/nonexistent/dir/config.json"), std::string::npos);
  // ... and why it cannot be read.
  EXPECT_TRUE(absl::IsNotFound(c.status())) << c.status();
  EXPECT_NE(c.status().message().find("No such file or directory"), std::string::npos)
      << c.status();
}

TEST(Config, LoadConfigSaysWhyItCannotRead) {
  const std::filesystem::path dir = testing_temp::fresh_dir("config");
  std::filesystem::create_directories(dir / "config.json");
  auto c = load_config((dir / "config.json").string());
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("is a directory"), std::string::npos) << c.status();
  EXPECT_EQ(c.status().message().find("JSON"), std::string::npos) << c.status();
  if (::geteuid() != 0) {  // root reads anything
    const std::filesystem::path locked = dir / "locked.json";
    std::ofstream(locked) << base().dump();
    std::filesystem::permissions(locked, std::filesystem::perms::none);
    auto l = load_config(locked.string());
    ASSERT_FALSE(l.ok());
    EXPECT_TRUE(absl::IsPermissionDenied(l.status())) << l.status();
    EXPECT_NE(l.status().message().find("Permission denied"), std::string::npos) << l.status();
  }
}

TEST(Config, LoadConfigRefusesWhatIsTooLargeToBeOne) {
  const std::filesystem::path dir = testing_temp::fresh_dir("config");
  // A valid config padded with spaces past 1 MiB: refused on its size, not parsed.
  const std::string padded = base().dump() + std::string((1 << 20) + 1, ' ');
  std::ofstream(dir / "config.json") << padded;
  auto c = load_config((dir / "config.json").string());
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(c.status())) << c.status();
  EXPECT_NE(c.status().message().find("is over 1048576 bytes"), std::string::npos) << c.status();
  // An endless device is read only that far.
  auto z = load_config("/dev/zero");
  ASSERT_FALSE(z.ok());
  EXPECT_NE(z.status().message().find("is over 1048576 bytes"), std::string::npos) << z.status();
  // Trailing whitespace well under the bound is still an ordinary config.
  std::ofstream(dir / "config.json", std::ios::trunc) << base().dump() + std::string(1000, ' ');
  EXPECT_TRUE(load_config((dir / "config.json").string()).ok());
}

TEST(Config, SyntaxErrorsSayWhere) {
  auto c = parse_config("{\n  \"d_model\": 256,\n  \"n_layers\" 4\n}\n");
  ASSERT_FALSE(c.ok());
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find("not valid JSON at line"), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 3, column 14"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(byte 33)"), std::string::npos) << msg;
}

// The bytes nlohmann quotes as "last read" are the file's: escaped like every other quote of it
// (a right-to-left override or a raw 0xFF went into the message as they were).
TEST(Config, SyntaxErrorsEscapeTheBytesRead) {
  for (const std::string& text : {std::string("{\"architecture\": \"\xe2\x80\xae"
                                              "evil\x01\"}"),
                                  std::string("{\"a\": \"x\xff\x01\"}")}) {
    auto c = parse_config(text);
    ASSERT_FALSE(c.ok());
    const std::string msg(c.status().message());
    EXPECT_NE(msg.find("last read: '"), std::string::npos) << msg;
    for (char ch : msg)
      EXPECT_TRUE(ch >= 0x20 && ch < 0x7f)
          << "byte " << int(static_cast<unsigned char>(ch)) << " in: " << absl::CHexEscape(msg);
  }
  auto c = parse_config(
      "{\"architecture\": \"\xe2\x80\xae"
      "evil\x01\"}");
  EXPECT_NE(c.status().message().find("last read: '\\\"\\xe2\\x80\\xae"), std::string::npos)
      << c.status();
}

// nlohmann's lexer ends the input at a NUL byte, so a config followed by a NUL and anything
// else (a half-overwritten file, a binary file whose first bytes are JSON) read as valid.
TEST(Config, NulBytesAreRefusedWhereTheyAre) {
  const std::string text = base().dump();
  auto c = parse_config(text + std::string(1, '\0') + "garbage");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("not valid JSON at line 1, column " +
                                      std::to_string(text.size() + 1) + " (byte " +
                                      std::to_string(text.size()) + "): a NUL byte"),
            std::string::npos)
      << c.status();
  // Inside a string too: a raw NUL is never JSON; the escape \u0000 is.
  EXPECT_FALSE(parse_json_strict(std::string("[\"a\0b\"]", 7)).ok());
  auto escaped = parse_json_strict(R"(["a\u0000b"])");
  ASSERT_TRUE(escaped.ok()) << escaped.status();
  EXPECT_EQ((*escaped)[0].get<std::string>(), std::string("a\0b", 3));
}

// Keys and values from the file are escaped in errors: a newline would forge a log line, and a
// right-to-left override (U+202E) would garble the rest of the message on a terminal.
TEST(Config, ErrorsEscapeWhatTheFileHolds) {
  nlohmann::json j = base();
  j["evil\nkey\u202e"] = 1;
  std::string e = error_of(j);
  EXPECT_NE(e.find("unknown key 'evil\\nkey\\xe2\\x80\\xae'"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  j = base();
  j["attention"]["type"] = "cem\n";
  e = error_of(j);
  EXPECT_NE(e.find("= \"cem\\n\" is not one of"), std::string::npos) << e;
  j = base();
  j["architecture"] = "cemlm\n\u202e";
  e = error_of(j);
  EXPECT_NE(e.find("'architecture' = \"cemlm\\n\\xe2\\x80\\xae\" must be"), std::string::npos) << e;
  std::string text = base().dump();
  text.insert(text.rfind('}'), ", \"a\\nb\": 1, \"a\\nb\": 2");
  auto c = parse_config(text);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("duplicate key \"a\\nb\""), std::string::npos) << c.status();
}

TEST(Config, DuplicateKeysAreRefusedByName) {
  // "Last one wins" would silently drop the first value; nested objects are checked too.
  std::string text = base().dump();
  text.insert(text.rfind('}'), ", \"d_model\": 128");
  auto c = parse_config(text);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("duplicate key \"d_model\""), std::string::npos)
      << c.status();
  std::string nested = base().dump();
  const size_t lev = nested.find("\"rank\":");
  ASSERT_NE(lev, std::string::npos);
  nested.insert(lev, "\"rank\": 4, ");
  c = parse_config(nested);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("duplicate key \"embedding.lev.rank\""), std::string::npos)
      << c.status();
  // The same key in different objects is no duplicate.
  EXPECT_TRUE(parse_config(base().dump()).ok());
}

TEST(Config, DuplicateKeysInsideArraysAreNamedWithTheirIndex) {
  auto j = parse_json_strict(R"({"a": [{"b": 1}, {"c": [[], {"d": 1, "d": 2}]}]})");
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("duplicate key \"a[1].c[1].d\""), std::string::npos)
      << j.status();
}

// The tree is nlohmann's own for any document without a repeated key (values of every kind,
// nested both ways, escapes, numbers of each type).
TEST(Config, StrictParseBuildsTheSameTreeAsNlohmann) {
  const std::string docs[] = {
      R"({"a": 1, "b": -2, "c": 18446744073709551615, "d": 2.5e-3, "e": "x\u00e9\"y",
          "f": [true, false, null, [], {}, [[1], {"g": [2, {"h": null}]}]], "i": {"j": {"k": []}}})",
      R"([1, "two", 3.0, {"four": [5, {"six": 6}]}, [[[]]]])", R"("just a string")", "42", "{}"};
  for (const std::string& d : docs) {
    auto got = parse_json_strict(d);
    ASSERT_TRUE(got.ok()) << got.status() << "\n" << d;
    EXPECT_EQ(*got, nlohmann::json::parse(d)) << d;
    EXPECT_EQ(got->dump(), nlohmann::json::parse(d).dump()) << d;
  }
}

// Many small entries: nlohmann's parser with a callback (which this used) rescanned the enclosing
// container at the end of every object, 60 s for a 1 MB config.json of 100,000 "key":{} pairs
// (hours for the 100 MB a safetensors header may hold). 300,000 of them, and a repeat of the
// first key after them all, still named.
TEST(Config, ManyEntriesParseAndAKeyRepeatedAfterThemIsNamed) {
  const int n = 300000;
  std::string text = "{";
  for (int i = 0; i < n; ++i)
    absl::StrAppend(&text, i ? "," : "", "\"k", i, "\":{\"v\":[", i, "]}");
  auto j = parse_json_strict(text + "}");
  ASSERT_TRUE(j.ok()) << j.status();
  ASSERT_EQ(j->size(), size_t(n));
  EXPECT_EQ((*j)["k12345"]["v"][0], 12345);
  EXPECT_EQ((*j)[absl::StrCat("k", n - 1)]["v"][0], n - 1);
  j = parse_json_strict(text + ",\"k0\":{}}");
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("duplicate key \"k0\""), std::string::npos) << j.status();
  std::string array = "[";
  for (int i = 0; i < n; ++i) absl::StrAppend(&array, i ? "," : "", "{}");
  j = parse_json_strict(array + "]");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->size(), size_t(n));
}

// Every open array or object kept a copy of its whole path, so memory grew with the square of
// the depth (40 KB of "[[[..." took a gigabyte, 120 KB more than two), and a deep tree could
// overflow the stack when printed. Nesting is capped at 64, far beyond the 3 levels of a
// config.json or a safetensors header, and refused before anything is allocated.
TEST(Config, DeepNestingIsRefusedWhereItStarts) {
  const auto nested = [](size_t depth) {
    return std::string(depth, '[') + std::string(depth, ']');
  };
  EXPECT_TRUE(parse_json_strict(nested(64)).ok());
  auto j = parse_json_strict(nested(65));
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("line 1, column 65 (byte 64): nested more than 64"),
            std::string::npos)
      << j.status();
  // Brackets inside strings are text, not nesting.
  EXPECT_TRUE(parse_json_strict("[\"" + std::string(1000, '[') + "\\\"\"]").ok());
  // 10^4 levels took 150 MB before the cap; now they are refused at the 65th bracket.
  j = parse_json_strict(nested(10000));
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("nested more than 64"), std::string::npos) << j.status();
  std::string text = base().dump();
  text.insert(text.rfind('}'), ", \"x\": " + std::string(100, '{'));
  auto c = parse_config(text);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("config: not valid JSON at line 1"), std::string::npos)
      << c.status();
  EXPECT_NE(c.status().message().find("nested more than 64"), std::string::npos) << c.status();
}

// A number beyond a double (1e999) failed with nlohmann's own words, without a position, and the
// hint for a syntax error: "not valid JSON: [json.exception.out_of_range.406] number overflow
// parsing '1e999' (check commas, quotes and braces)". It is said where it is, in plain words.
TEST(Config, NumbersBeyondADoubleAreRefusedWhereTheyAre) {
  nlohmann::json j = base();
  j["norm_eps"] = 12345;
  std::string text = j.dump();
  const size_t at = text.find("12345");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 5, "1e999");
  auto c = parse_config(text);
  ASSERT_FALSE(c.ok());
  const std::string msg(c.status().message());
  EXPECT_NE(msg.find("config: not valid JSON at line 1, column " + std::to_string(at + 1) +
                     " (byte " + std::to_string(at) + "): the number 1e999 is beyond the range"),
            std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("json.exception"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("check commas"), std::string::npos) << msg;
  // The same text inside a string is no number; the one after it is found.
  auto k = parse_json_strict(R"({"a": "-1e400", "b": -1e400})");
  ASSERT_FALSE(k.ok());
  EXPECT_NE(k.status().message().find("(byte 21): the number -1e400"), std::string::npos)
      << k.status();
}

// A number below a double's range read as 0, and was refused as 0 ("'norm_eps' = 0 is out of
// range"); it is said as written. Zeros, and tiny numbers a double holds, are numbers as before.
TEST(Config, NumbersBelowADoubleAreRefusedWhereTheyAre) {
  nlohmann::json j = base();
  j["norm_eps"] = 12345;
  std::string text = j.dump();
  const size_t at = text.find("12345");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 5, "1e-400");
  auto c = parse_config(text);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(
                "config: not valid JSON at line 1, column " + std::to_string(at + 1) + " (byte " +
                std::to_string(at) +
                "): the number 1e-400 is below the range of a 64-bit float (it would read as 0)"),
            std::string::npos)
      << c.status();
  for (const char* fine : {"0.0", "-0e5", "0.000e-999", "1e-310", "4.9e-324"}) {
    auto v = parse_json_strict(absl::StrCat("[", fine, "]"));
    ASSERT_TRUE(v.ok()) << fine << ": " << v.status();
  }
  EXPECT_FALSE(parse_json_strict("[-2.5E-999]").ok());
}

}  // namespace
}  // namespace cemlm
