// Checkpoint directories: bit-exact round trip for every variant, BF16 weights, refusal of
// missing/extra/mis-shaped/truncated/non-finite tensors by name, and atomic replacement.
#include "cemlm/engine/checkpoint.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>

#include "cemlm/engine/safetensors.h"
#include "io_test_util.h"
#include "nlohmann/json.hpp"

namespace cemlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_io::fresh_dir;
using testing_io::list_dir;
using testing_io::raw;
using testing_io::read_bytes;
using testing_io::safetensors_bytes;
using testing_io::write_bytes;

json small_config() {
  return json::parse(R"({
    "architecture": "cemlm", "format_version": 1,
    "vocab_size": 50, "d_model": 8, "n_layers": 2, "n_heads": 2, "head_dim": 4, "d_ff": 12,
    "embedding": { "type": "table" },
    "attention": { "type": "standard" },
    "mlp": { "type": "swiglu" } })");
}

ModelConfig config_of(const json& j) {
  auto c = parse_config(j.dump());
  EXPECT_TRUE(c.ok()) << c.status() << "\n" << j.dump();
  return c.ok() ? *c : ModelConfig{};
}

// One config per variant axis value: embedding table/tied/lev, attention standard/cem × diag,
// precond 0/r on both sub-layers, swiglu/cem.
std::vector<json> variants() {
  std::vector<json> v;
  v.push_back(small_config());
  json tied = small_config();
  tied["embedding"]["tie_output"] = true;
  v.push_back(tied);
  for (const char* diag : {"none", "shared", "per_head"})
    for (int r : {0, 3}) {
      json j = small_config();
      j["embedding"] = {
          {"type", "lev"},
          {"lev", {{"digits", 2}, {"seed_dim", 4}, {"knots", 3}, {"rank", 2}, {"heads", 2}}}};
      j["attention"] = {{"type", "cem"}, {"diag", diag}, {"precond_rank", r}};
      j["mlp"] = {{"type", "cem"}, {"precond_rank", 3 - r}};
      v.push_back(j);
    }
  return v;
}

ParamStore random_params(const ModelConfig& c, uint64_t seed) {
  ParamStore p(c);
  p.init_random(seed);
  return p;
}

TEST(Checkpoint, RoundTripIsBitExactForEveryVariant) {
  const std::string dir = fresh_dir();
  for (const json& j : variants()) {
    const ModelConfig c = config_of(j);
    const ParamStore p = random_params(c, 7);
    const std::string ck = dir + "/ck";
    ASSERT_TRUE(save_checkpoint(ck, c, p).ok()) << c.variant_name();
    auto loaded = load_checkpoint(ck);
    ASSERT_TRUE(loaded.ok()) << c.variant_name() << ": " << loaded.status();
    EXPECT_EQ(config_to_json(loaded->config), config_to_json(c)) << c.variant_name();
    ASSERT_EQ(loaded->params.size(), p.size()) << c.variant_name();
    EXPECT_EQ(std::memcmp(loaded->params.flat().data(), p.flat().data(), p.size() * 4), 0)
        << c.variant_name();
    EXPECT_TRUE(loaded->tokenizer_path.empty());
    // Tensors are stored in layout order.
    auto file = SafetensorsFile::open(ck + "/model.safetensors");
    ASSERT_TRUE(file.ok());
    ASSERT_EQ(file->tensors().size(), p.specs().size());
    for (size_t i = 0; i < p.specs().size(); ++i)
      EXPECT_EQ(file->tensors()[i].name, p.specs()[i].name);
  }
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ck"}) << "temporary directory left";
}

TEST(Checkpoint, TokenizerIsCopied) {
  const std::string dir = fresh_dir();
  write_bytes(dir + "/sp.model", "not really a sentencepiece model");
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(dir + "/ck/", c, random_params(c, 1), dir + "/sp.model").ok());
  auto loaded = load_checkpoint(dir + "/ck");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tokenizer_path, dir + "/ck/tokenizer.model");
  EXPECT_EQ(read_bytes(loaded->tokenizer_path), "not really a sentencepiece model");
}

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t(u >> 16);
}

TEST(Checkpoint, Bf16WeightsLoadAsF32) {
  const std::string ck = fresh_dir() + "/ck";
  const ModelConfig c = config_of(small_config());
  const ParamStore p = random_params(c, 3);
  ASSERT_TRUE(save_checkpoint(ck, c, p).ok());
  json header;
  std::string body;
  for (const ParamSpec& s : p.specs()) {
    std::vector<uint16_t> h;
    for (int64_t i = 0; i < s.numel(); ++i) h.push_back(to_bf16(p.flat()[s.offset + i]));
    header[s.name] = {{"dtype", "BF16"},
                      {"shape", s.shape},
                      {"data_offsets", {body.size(), body.size() + 2 * h.size()}}};
    body += raw(h);
  }
  write_bytes(ck + "/model.safetensors", safetensors_bytes(header.dump(), body));
  auto loaded = load_checkpoint(ck);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (int64_t i = 0; i < p.size(); ++i) {
    const uint32_t bits = uint32_t(to_bf16(p.flat()[i])) << 16;
    float want;
    std::memcpy(&want, &bits, 4);
    ASSERT_EQ(loaded->params.flat()[i], want) << i;
  }
}

// Rewrites model.safetensors from the saved tensors after `edit` changes the list.
void rewrite_weights(const std::string& ck, const ParamStore& p,
                     const std::function<void(std::vector<NamedTensor>&)>& edit) {
  std::vector<NamedTensor> t;
  for (const ParamSpec& s : p.specs())
    t.push_back({s.name, s.shape, {p.flat().data() + s.offset, size_t(s.numel())}});
  edit(t);
  ASSERT_TRUE(write_safetensors(ck + "/model.safetensors", t).ok());
}

std::string load_error(const std::string& ck) {
  auto loaded = load_checkpoint(ck);
  EXPECT_FALSE(loaded.ok());
  return loaded.ok() ? "" : std::string(loaded.status().message());
}

TEST(Checkpoint, BadWeightsAreRefusedByName) {
  const std::string ck = fresh_dir() + "/ck";
  const ModelConfig c = config_of(small_config());
  const ParamStore p = random_params(c, 5);
  ASSERT_TRUE(save_checkpoint(ck, c, p).ok());
  const std::vector<float> nan_values(12 * 8, std::nanf(""));
  const std::vector<float> extra = {1.0f};

  rewrite_weights(ck, p, [](auto& t) { t.erase(t.begin() + 3); });
  EXPECT_NE(load_error(ck).find("'" + p.specs()[3].name + "'"), std::string::npos);

  rewrite_weights(ck, p, [&](auto& t) { t.push_back({"layers.0.attn.bogus", {1}, extra}); });
  EXPECT_NE(load_error(ck).find("'layers.0.attn.bogus'"), std::string::npos);

  rewrite_weights(ck, p, [](auto& t) {
    for (auto& x : t)
      if (x.name == "layers.1.mlp.w_up") x.shape = {8, 12};
  });
  const std::string shape_err = load_error(ck);
  EXPECT_NE(shape_err.find("'layers.1.mlp.w_up'"), std::string::npos) << shape_err;
  EXPECT_NE(shape_err.find("[8, 12]"), std::string::npos) << shape_err;
  EXPECT_NE(shape_err.find("[12, 8]"), std::string::npos) << shape_err;

  rewrite_weights(ck, p, [&](auto& t) {
    for (auto& x : t)
      if (x.name == "layers.0.mlp.w_gate") x.data = nan_values;
  });
  EXPECT_NE(load_error(ck).find("'layers.0.mlp.w_gate'"), std::string::npos);

  rewrite_weights(ck, p, [](auto&) {});
  const std::string full = read_bytes(ck + "/model.safetensors");
  write_bytes(ck + "/model.safetensors", full.substr(0, full.size() - 4));
  EXPECT_NE(load_error(ck).find("'" + p.specs().back().name + "'"), std::string::npos);

  fs::remove(ck + "/model.safetensors");
  EXPECT_NE(load_error(ck).find("model.safetensors"), std::string::npos);
  fs::remove(ck + "/config.json");
  EXPECT_NE(load_error(ck).find("config.json"), std::string::npos);
}

// A header longer than the config's tensors need (metadata of megabytes) is refused before it is
// parsed, which takes ~20× its bytes: a 100 MB one took 2.2 GB and 18 s to be refused. Metadata
// of a size a writer may mean (here 100 KB) still loads.
TEST(Checkpoint, AHeaderLongerThanTheConfigNeedsIsRefusedUnparsed) {
  const std::string ck = fresh_dir() + "/ck";
  const ModelConfig c = config_of(small_config());
  const ParamStore p = random_params(c, 5);
  ASSERT_TRUE(save_checkpoint(ck, c, p).ok());
  std::vector<NamedTensor> t;
  for (const ParamSpec& s : p.specs())
    t.push_back({s.name, s.shape, {p.flat().data() + s.offset, size_t(s.numel())}});
  ASSERT_TRUE(
      write_safetensors(ck + "/model.safetensors", t, {{"notes", std::string(100 << 10, 'x')}})
          .ok());
  EXPECT_TRUE(load_checkpoint(ck).ok());
  const uint64_t most = max_header_bytes(p.specs().size());
  ASSERT_TRUE(
      write_safetensors(ck + "/model.safetensors", t, {{"notes", std::string(size_t(most), 'x')}})
          .ok());
  const std::string err = load_error(ck);
  EXPECT_NE(err.find("is more than a file of " + std::to_string(p.specs().size()) +
                     " tensors needs (" + std::to_string(most) + " bytes at most"),
            std::string::npos)
      << err;
}

TEST(Checkpoint, ConfigThatDoesNotMatchTheWeightsIsRefusedByName) {
  const std::string ck = fresh_dir() + "/ck";
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 5)).ok());
  json tied = small_config();
  tied["embedding"]["tie_output"] = true;
  write_bytes(ck + "/config.json", tied.dump());
  EXPECT_NE(load_error(ck).find("'lm_head.weight'"), std::string::npos);
}

// The same shapes split into other heads (2 of 4 -> 1 of 8): another model, refused naming the
// fields; a file whose writer did not record them loads as before.
TEST(Checkpoint, ConfigSplittingTheWeightsIntoOtherHeadsIsRefused) {
  const std::string ck = fresh_dir() + "/ck";
  for (const json& variant : variants()) {
    const ModelConfig c = config_of(variant);
    ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 5)).ok());
    json resplit = variant;
    resplit["n_heads"] = 1;
    resplit["head_dim"] = 8;
    write_bytes(ck + "/config.json", resplit.dump());
    const std::string error = load_error(ck);
    if (variant["attention"].value("diag", "") == "per_head") {  // its diag's shape shows it
      EXPECT_NE(error.find("has shape"), std::string::npos) << error;
      continue;
    }
    EXPECT_NE(error.find("the weights were saved for n_heads = 2, config.json says 1"),
              std::string::npos)
        << error;
    resplit["n_heads"] = 2;  // restored: loads
    resplit["head_dim"] = 4;
    write_bytes(ck + "/config.json", resplit.dump());
    EXPECT_TRUE(load_checkpoint(ck).ok()) << variant.dump();
  }
  // Without the entries (another writer's file): not checked.
  const ModelConfig c = config_of(small_config());
  const ParamStore p = random_params(c, 6);
  std::vector<NamedTensor> tensors;
  for (const ParamSpec& s : p.specs())
    tensors.push_back(
        NamedTensor{s.name, s.shape, {p.flat().data() + s.offset, size_t(s.numel())}});
  ASSERT_TRUE(write_safetensors(ck + "/model.safetensors", tensors).ok());
  json resplit = small_config();
  resplit["n_heads"] = 1;
  resplit["head_dim"] = 8;
  write_bytes(ck + "/config.json", resplit.dump());
  EXPECT_TRUE(load_checkpoint(ck).ok());
}

// A FIFO as config.json (as for model.safetensors): refused by name at once; opening it would
// wait for a writer forever.
TEST(Checkpoint, FifoConfigIsRefusedWithoutWaiting) {
  const std::string ck = fresh_dir() + "/ck";
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 5)).ok());
  const std::string config = ck + "/config.json";
  ASSERT_TRUE(std::filesystem::remove(config));
  ASSERT_EQ(::mkfifo(config.c_str(), 0600), 0) << std::strerror(errno);
  auto pending = std::async(std::launch::async, [&] { return load_checkpoint(ck); });
  if (pending.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    ADD_FAILURE() << "loading a checkpoint whose config.json is a FIFO still waits after 5 s";
    const int w = ::open(config.c_str(), O_WRONLY | O_NONBLOCK);  // unblock it: empty input
    if (w >= 0) ::close(w);
  }
  auto loaded = pending.get();
  ASSERT_FALSE(loaded.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(loaded.status())) << loaded.status();
  EXPECT_NE(loaded.status().message().find("config.json' is not a regular file"), std::string::npos)
      << loaded.status();
}

// A checkpoint without its weights file, or with something else under its name, is said as such
// (the reader's own words told a user who named the directory to name a .safetensors file); a
// path to the checkpoint's config.json, not its directory, says to name the directory.
TEST(Checkpoint, MissingOrMisplacedPartsAreSaidAsACheckpoints) {
  const std::string ck = fresh_dir() + "/ck";
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 5)).ok());
  const std::string weights = ck + "/model.safetensors";
  ASSERT_TRUE(std::filesystem::remove(weights));
  auto loaded = load_checkpoint(ck);
  ASSERT_FALSE(loaded.ok());
  EXPECT_TRUE(absl::IsNotFound(loaded.status())) << loaded.status();
  EXPECT_NE(loaded.status().message().find("'" + ck + "' has config.json but no model.safetensors"),
            std::string::npos)
      << loaded.status();
  const std::pair<std::function<void()>, std::string> kinds[] = {
      {[&] { std::filesystem::create_directory(weights); }, "' is a directory"},
      {[&] { ASSERT_EQ(::mkfifo(weights.c_str(), 0600), 0); }, "' is not a regular file"}};
  for (const auto& [make, what] : kinds) {
    std::filesystem::remove(weights);
    make();
    loaded = load_checkpoint(ck);
    ASSERT_FALSE(loaded.ok()) << what;
    EXPECT_TRUE(absl::IsInvalidArgument(loaded.status())) << loaded.status();
    EXPECT_NE(loaded.status().message().find("'" + weights + what +
                                             ": a checkpoint's model.safetensors must be"),
              std::string::npos)
        << loaded.status();
  }
  loaded = load_checkpoint(ck + "/config.json");
  ASSERT_FALSE(loaded.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(loaded.status())) << loaded.status();
  EXPECT_NE(loaded.status().message().find("config.json' is not a directory: name the checkpoint"),
            std::string::npos)
      << loaded.status();
  // A link to weights that are gone (a copied folder of relative links) is said as such.
  std::filesystem::remove(weights);
  std::filesystem::create_symlink("../blobs/gone", weights);
  loaded = load_checkpoint(ck);
  ASSERT_FALSE(loaded.ok());
  EXPECT_TRUE(absl::IsNotFound(loaded.status())) << loaded.status();
  EXPECT_NE(loaded.status().message().find(
                "'" + weights + "' is a symbolic link to '../blobs/gone', which does not exist"),
            std::string::npos)
      << loaded.status();
}

// A tokenizer.model that is no file to read (a directory, a FIFO, a link to nothing) is an error
// naming it: it read as "no tokenizer", and `train --init` trained another one for the weights.
// No entry at all is a checkpoint without a tokenizer; a link to a file is its tokenizer.
TEST(Checkpoint, ATokenizerEntryThatIsNoFileIsRefused) {
  const std::string ck = fresh_dir() + "/ck";
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 5)).ok());
  const std::string tok = ck + "/tokenizer.model";
  auto loaded = load_checkpoint(ck);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tokenizer_path, "");
  const std::string elsewhere = fresh_dir() + "/some.model";
  std::ofstream(elsewhere) << "bytes";
  std::filesystem::create_symlink(elsewhere, tok);
  loaded = load_checkpoint(ck);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->tokenizer_path, tok);
  const std::pair<std::function<void()>, std::string> kinds[] = {
      {[&] { std::filesystem::create_directory(tok); }, "' is not a regular file"},
      {[&] { ASSERT_EQ(::mkfifo(tok.c_str(), 0600), 0); }, "' is not a regular file"},
      {[&] { std::filesystem::create_symlink(ck + "/nothing", tok); }, "' is a link to nothing"}};
  for (const auto& [make, what] : kinds) {
    std::filesystem::remove(tok);
    make();
    loaded = load_checkpoint(ck);
    ASSERT_FALSE(loaded.ok()) << what;
    EXPECT_TRUE(absl::IsInvalidArgument(loaded.status())) << loaded.status();
    EXPECT_NE(loaded.status().message().find("'" + tok + what), std::string::npos)
        << loaded.status();
  }
}

// A config.json far larger than its weights (here ~100 GB of parameters beside a few KB) is
// refused naming the tensor whose shape differs, before the parameters are allocated: it once
// allocated them first and died of out-of-memory.
TEST(Checkpoint, ConfigFarLargerThanTheWeightsIsRefusedBeforeAllocating) {
  const std::string ck = fresh_dir() + "/ck";
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 5)).ok());
  json huge = small_config();
  huge["vocab_size"] = 200000;
  huge["d_model"] = 65536;
  write_bytes(ck + "/config.json", huge.dump());
  const std::string err = load_error(ck);
  EXPECT_NE(err.find("tensor 'embed.weight' has shape [50, 8], config.json expects [200000, 65536]"),
            std::string::npos)
      << err;
}

TEST(Checkpoint, SaveReplacesAnOldCheckpointWholly) {
  const std::string dir = fresh_dir(), ck = dir + "/ck";
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 1)).ok());
  write_bytes(ck + "/" + kLossCurveFile, "from an older save, which this one does not write");
  const ParamStore p2 = random_params(c, 2);
  ASSERT_TRUE(save_checkpoint(ck, c, p2, "", [](const std::string& tmp) {
                write_bytes(tmp + "/optimizer.safetensors", "state");
                return absl::OkStatus();
              }).ok());
  auto loaded = load_checkpoint(ck);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->params.flat(), p2.flat());
  EXPECT_EQ(list_dir(ck), (std::vector<std::string>{"config.json", "model.safetensors",
                                                    "optimizer.safetensors"}));
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ck"});
}

// A save keeps the replaced directory's mode: a `chmod 700` on a private checkpoint was undone
// (755 under the usual umask) by the next save of a run.
TEST(Checkpoint, SaveKeepsTheModeOfTheDirectoryItReplaces) {
  const std::string dir = fresh_dir(), ck = dir + "/ck";
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 1)).ok());
  for (auto mode : {fs::perms::owner_all,
                    fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec}) {
    fs::permissions(ck, mode);
    ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 2)).ok());
    EXPECT_EQ(fs::status(ck).permissions(), mode);
  }
}

TEST(Checkpoint, FailedSaveLeavesTheOldCheckpointIntact) {
  const std::string dir = fresh_dir(), ck = dir + "/ck";
  const ModelConfig c = config_of(small_config());
  const ParamStore p1 = random_params(c, 1);
  ASSERT_TRUE(save_checkpoint(ck, c, p1).ok());
  const std::string old_weights = read_bytes(ck + "/model.safetensors");

  ParamStore p2 = random_params(c, 2);
  auto st = save_checkpoint(ck, c, p2, "", [](const std::string& tmp) {
    write_bytes(tmp + "/optimizer.safetensors", "half");
    return absl::InternalError("simulated crash while writing optimizer state");
  });
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("simulated"), std::string::npos);

  st = save_checkpoint(ck, c, p2, dir + "/no_such_tokenizer.model");
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("no_such_tokenizer.model"), std::string::npos) << st.message();

  p2.flat()[p2.specs()[2].offset] = INFINITY;
  st = save_checkpoint(ck, c, p2);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'" + p2.specs()[2].name + "'"), std::string::npos) << st.message();

  EXPECT_EQ(read_bytes(ck + "/model.safetensors"), old_weights);
  EXPECT_EQ(list_dir(ck), (std::vector<std::string>{"config.json", "model.safetensors"}));
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ck"}) << "temporary directory left";
  auto loaded = load_checkpoint(ck);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->params.flat(), p1.flat());
}

TEST(Checkpoint, SaveRefusesToReplaceSomethingElse) {
  const std::string dir = fresh_dir();
  const ModelConfig c = config_of(small_config());
  fs::create_directories(dir + "/notes");
  write_bytes(dir + "/notes/todo.txt", "keep me");
  auto st = save_checkpoint(dir + "/notes", c, random_params(c, 1));
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("notes"), std::string::npos) << st.message();
  EXPECT_EQ(read_bytes(dir + "/notes/todo.txt"), "keep me");
  write_bytes(dir + "/file", "x");
  EXPECT_FALSE(save_checkpoint(dir + "/file", c, random_params(c, 1)).ok());
  EXPECT_EQ(read_bytes(dir + "/file"), "x");
  // An empty directory is fine to fill.
  fs::create_directories(dir + "/empty");
  EXPECT_TRUE(save_checkpoint(dir + "/empty", c, random_params(c, 1)).ok());
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{"empty", "file", "notes"}));
  // Under a file, nothing can be made; the check says so up front.
  const absl::Status under_file = check_checkpoint_target(dir + "/file/ck");
  EXPECT_EQ(under_file.code(), absl::StatusCode::kFailedPrecondition) << under_file;
  EXPECT_NE(under_file.message().find("'" + dir + "/file': not a directory"), std::string::npos)
      << under_file;
}

// The check creates nothing (a trainer refused later, for a flag, left --out's parents behind);
// the save creates the missing parents.
TEST(Checkpoint, CheckCreatesNothingAndSaveCreatesTheParents) {
  const std::string dir = fresh_dir();
  const ModelConfig c = config_of(small_config());
  EXPECT_TRUE(check_checkpoint_target(dir + "/a/b/ck").ok());
  EXPECT_TRUE(check_checkpoint_target("relative-name-not-here/ck").ok());
  EXPECT_TRUE(list_dir(dir).empty());
  EXPECT_FALSE(fs::exists("relative-name-not-here"));
  ASSERT_TRUE(save_checkpoint(dir + "/a/b/ck", c, random_params(c, 1)).ok());
  EXPECT_TRUE(load_checkpoint(dir + "/a/b/ck").ok());
}

// Saving swaps in a whole new directory, so a checkpoint directory holding anything besides
// checkpoint files (notes, a nested run, a dump) is refused rather than emptied; the trainer's
// own files are checkpoint files.
TEST(Checkpoint, SaveRefusesACheckpointDirectoryHoldingOtherFiles) {
  const std::string dir = fresh_dir();
  const ModelConfig c = config_of(small_config());
  const std::string ck = dir + "/ck";
  ASSERT_TRUE(save_checkpoint(ck, c, random_params(c, 1)).ok());
  for (const char* name : {kOptimizerFile, kTrainerStateFile, kMetricsFile, kLossCurveFile})
    write_bytes(ck + "/" + name, "from a training run");
  EXPECT_TRUE(save_checkpoint(ck, c, random_params(c, 2)).ok()) << "trainer files are refused";
  auto refused_naming = [&](const std::string& name) {
    const auto st = save_checkpoint(ck, c, random_params(c, 3));
    EXPECT_FALSE(st.ok()) << name;
    EXPECT_NE(st.message().find("'" + name + "'"), std::string::npos) << st.message();
    EXPECT_EQ(check_checkpoint_target(ck).code(), st.code());
  };
  write_bytes(ck + "/NOTES.md", "keep me");
  refused_naming("NOTES.md");
  EXPECT_EQ(read_bytes(ck + "/NOTES.md"), "keep me");
  fs::remove(ck + "/NOTES.md");
  fs::create_directories(ck + "/sub/deeper");  // a run nested in another's directory
  refused_naming("sub");
  EXPECT_TRUE(fs::is_directory(ck + "/sub/deeper"));
  fs::remove_all(ck + "/sub");
  fs::create_directories(ck + "/" + kMetricsFile);  // a known name, but not a file
  refused_naming(kMetricsFile);
  fs::remove_all(ck + "/" + kMetricsFile);
  auto loaded = load_checkpoint(ck);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->params.flat(), random_params(c, 2).flat()) << "a refused save changed it";
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ck"}) << "temporary directory left";
}

// A volume's mount point (Docker's, a Kubernetes PVC's) cannot be swapped for a new directory:
// the save failed with EBUSY after the whole training. It is refused up front, naming a
// directory inside it, which works.
TEST(Checkpoint, SaveRefusesAMountPointUpFront) {
  const std::string vol = fresh_dir() + "/vol";
  fs::create_directories(vol);
  if (::mount("tmpfs", vol.c_str(), "tmpfs", 0, "size=16m") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{vol};
  const ModelConfig c = config_of(small_config());
  const absl::Status st = check_checkpoint_target(vol);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("'" + vol + "' is a mount point"), std::string::npos) << st;
  EXPECT_NE(st.message().find(vol + "/run1"), std::string::npos) << st;
  EXPECT_EQ(save_checkpoint(vol, c, random_params(c, 1)).code(), st.code());
  ASSERT_TRUE(save_checkpoint(vol + "/run1", c, random_params(c, 1)).ok());
  ASSERT_TRUE(save_checkpoint(vol + "/run1", c, random_params(c, 2)).ok());
  EXPECT_TRUE(load_checkpoint(vol + "/run1").ok());
}

// An output path that is a symbolic link (models/latest -> run3) saves into what it points at,
// and the link stays a link.
TEST(Checkpoint, SaveThroughASymlinkReplacesItsTarget) {
  const std::string dir = fresh_dir();
  const ModelConfig c = config_of(small_config());
  ASSERT_TRUE(save_checkpoint(dir + "/run3", c, random_params(c, 1)).ok());
  fs::create_directory_symlink("run3", dir + "/latest");
  EXPECT_EQ(checkpoint_target_path(dir + "/latest/"), fs::path(dir + "/run3").lexically_normal());
  ASSERT_TRUE(save_checkpoint(dir + "/latest", c, random_params(c, 2)).ok());
  EXPECT_TRUE(fs::is_symlink(dir + "/latest"));
  auto loaded = load_checkpoint(dir + "/run3");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->params.flat(), random_params(c, 2).flat());
  // A link to a directory not made yet: the save makes it.
  fs::create_directory_symlink("run4", dir + "/next");
  ASSERT_TRUE(save_checkpoint(dir + "/next", c, random_params(c, 3)).ok());
  EXPECT_TRUE(fs::is_symlink(dir + "/next"));
  EXPECT_TRUE(load_checkpoint(dir + "/run4").ok());
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{"latest", "next", "run3", "run4"}));
}

TEST(Checkpoint, SaveRefusesParamsOfAnotherConfig) {
  const std::string dir = fresh_dir();
  const ModelConfig c = config_of(small_config());
  json tied = small_config();
  tied["embedding"]["tie_output"] = true;
  EXPECT_FALSE(save_checkpoint(dir + "/ck", config_of(tied), random_params(c, 1)).ok());
  EXPECT_TRUE(list_dir(dir).empty());
}

}  // namespace
}  // namespace cemlm
