// `cemlm init` and `cemlm inspect` through their entry points: flags, exit codes, a loadable
// and seed-deterministic checkpoint, and inspect's counts against count_params.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cemlm/cli/commands.h"
#include "cemlm/engine/checkpoint.h"
#include "io_test_util.h"

namespace cemlm {
namespace {

using testing_io::fresh_dir;
using testing_io::read_bytes;
using testing_io::write_bytes;

constexpr char kConfig[] = R"({
  "architecture": "cemlm", "format_version": 1,
  "vocab_size": 64, "d_model": 16, "n_layers": 2, "n_heads": 2, "head_dim": 8, "d_ff": 24,
  "embedding": { "type": "lev", "lev": { "digits": 2, "seed_dim": 4, "knots": 4, "rank": 2, "heads": 2 } },
  "attention": { "type": "cem", "diag": "per_head", "precond_rank": 2 },
  "mlp": { "type": "cem" } })";

int run(int (*cmd)(int, char**), std::vector<std::string> args) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return cmd(int(argv.size()), argv.data());
}

TEST(InitCommand, WritesALoadableSeedDeterministicCheckpoint) {
  const std::string dir = fresh_dir(), cfg = dir + "/config.json";
  write_bytes(cfg, kConfig);
  ASSERT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", dir + "/a", "--seed", "5"}), 0);
  ASSERT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", dir + "/b", "--seed", "5"}), 0);
  ASSERT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", dir + "/c", "--seed", "6"}), 0);
  auto a = load_checkpoint(dir + "/a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->config.variant_name(), "cem-attn(per_head,r2)+cem-mlp(r0)+lev");
  EXPECT_EQ(read_bytes(dir + "/a/model.safetensors"), read_bytes(dir + "/b/model.safetensors"));
  EXPECT_NE(read_bytes(dir + "/a/model.safetensors"), read_bytes(dir + "/c/model.safetensors"));
  // Recommended init: norm gains are one, diag starts at zero.
  EXPECT_EQ(a->params.flat()[a->params.find("final_norm.weight")->offset], 1.0f);
  EXPECT_EQ(a->params.flat()[a->params.find("layers.1.attn.diag")->offset], 0.0f);
}

// An empty --tokenizer is a usage error (it wrote a checkpoint without one, exit 0), and an empty
// checkpoint directory is named as such (it read as the current directory).
TEST(InitCommand, EmptyPathsAreRefused) {
  const std::string dir = fresh_dir(), cfg = dir + "/config.json";
  write_bytes(cfg, kConfig);
  testing::internal::CaptureStderr();
  EXPECT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", dir + "/a", "--tokenizer", ""}), 2);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("--tokenizer is empty"), std::string::npos) << err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/a/model.safetensors"));
  const auto none = load_checkpoint("");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("the checkpoint directory is empty"), std::string::npos)
      << none.status();
  // The config alone too (read first by the runner): "" read the working directory's config.json.
  const auto no_config = load_checkpoint_config("");
  ASSERT_FALSE(no_config.ok());
  EXPECT_NE(no_config.status().message().find("the checkpoint directory is empty"),
            std::string::npos)
      << no_config.status();
}

// A seed past 2^63 is said as given (it printed as a negative number).
TEST(InitCommand, SaysALargeSeedAsGiven) {
  const std::string dir = fresh_dir(), cfg = dir + "/config.json";
  write_bytes(cfg, kConfig);
  testing::internal::CaptureStdout();
  ASSERT_EQ(run(cli::cmd_init,
                {"--config", cfg, "--out", dir + "/a", "--seed", "18446744073709551615"}),
            0);
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("seed 18446744073709551615"), std::string::npos) << out;
}

// A checkpoint in --out (a trained run's as likely as not) is replaced only with --force.
TEST(InitCommand, AnExistingCheckpointIsReplacedOnlyWithForce) {
  const std::string dir = fresh_dir(), cfg = dir + "/config.json", out = dir + "/run";
  write_bytes(cfg, kConfig);
  ASSERT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", out, "--seed", "5"}), 0);
  const std::string weights = read_bytes(out + "/model.safetensors");
  testing::internal::CaptureStderr();
  EXPECT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", out, "--seed", "6"}), 1);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("holds a checkpoint already (model.safetensors); pass --force"),
            std::string::npos)
      << err;
  EXPECT_EQ(read_bytes(out + "/model.safetensors"), weights);
  ASSERT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", out, "--seed", "6", "--force"}), 0);
  EXPECT_NE(read_bytes(out + "/model.safetensors"), weights);
}

// While a training run holds --out's lock, init --force is refused naming the run: its next save
// would replace the new weights (init wrote them and exited 0). The lock released, it replaces.
TEST(InitCommand, ACheckpointATrainingRunHoldsIsNotReplaced) {
  const std::string dir = fresh_dir(), cfg = dir + "/config.json", out = dir + "/run";
  write_bytes(cfg, kConfig);
  ASSERT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", out, "--seed", "5"}), 0);
  const std::string weights = read_bytes(out + "/model.safetensors");
  const std::string lock = dir + "/.run.lock";
  EXPECT_EQ(checkpoint_lock_path(out + "/").string(), lock);
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);  // as a run holds it
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  ASSERT_EQ(::write(fd, "4242", 4), 4);
  testing::internal::CaptureStderr();
  EXPECT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", out, "--seed", "6", "--force"}), 1);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("--out '" + out +
                     "' is in use: a cemlm train run (pid 4242) holds its lock '" + lock + "'"),
            std::string::npos)
      << err;
  EXPECT_EQ(read_bytes(out + "/model.safetensors"), weights);
  ::close(fd);
  ASSERT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", out, "--seed", "6", "--force"}), 0);
  EXPECT_NE(read_bytes(out + "/model.safetensors"), weights);
}

TEST(InitCommand, BadInvocationsFail) {
  const std::string dir = fresh_dir();
  write_bytes(dir + "/bad.json", R"({"architecture": "cemlm"})");
  EXPECT_EQ(run(cli::cmd_init, {"--out", dir + "/x"}), 2);  // --config missing
  EXPECT_EQ(run(cli::cmd_init, {"--config", dir + "/bad.json", "--out", dir + "/x"}), 1);
  write_bytes(dir + "/config.json", kConfig);
  EXPECT_EQ(run(cli::cmd_init, {"--config", dir + "/config.json", "--out", dir + "/x",
                                "--tokenizer", dir + "/missing.model"}),
            1);
  EXPECT_EQ(run(cli::cmd_init, {"--help"}), 0);
}

TEST(InspectCommand, PrintsCountsNextToTheBaseline) {
  const std::string dir = fresh_dir(), cfg = dir + "/config.json";
  write_bytes(cfg, kConfig);
  ASSERT_EQ(run(cli::cmd_init, {"--config", cfg, "--out", dir + "/ck"}), 0);
  auto c = load_config(cfg);
  ASSERT_TRUE(c.ok());
  const ParamCounts pc = count_params(*c);
  for (const std::string& path : {dir + "/ck", cfg}) {
    ::testing::internal::CaptureStdout();
    ASSERT_EQ(run(cli::cmd_inspect, {path}), 0);
    const std::string out = ::testing::internal::GetCapturedStdout();
    EXPECT_NE(out.find(c->variant_name()), std::string::npos) << out;
    EXPECT_NE(out.find("std-attn+swiglu+table"), std::string::npos) << out;
    // Small enough that no thousands separators appear.
    ASSERT_LT(pc.embedding, 1000);
    ASSERT_LT(c->kv_bytes_per_token(), 1000);
    EXPECT_NE(out.find(absl::StrCat(" ", pc.embedding, " ")), std::string::npos) << out;
    EXPECT_NE(out.find(absl::StrCat(" ", c->kv_bytes_per_token(), " ")), std::string::npos) << out;
    // int8: a byte per cached number and a 4-byte scale per head of each key or value row (and
    // per context row with a CEM diagonal), for this config's numbers.
    const int64_t numbers = c->kv_bytes_per_token() / 4;
    const int64_t scales =
        4 * c->n_layers *
        (c->attention == AttentionType::kStandard ? 2 * c->n_heads
                                                  : c->n_heads + (c->diag != DiagMode::kNone));
    // Each on its own line; bf16: two bytes a cached number, no scales.
    auto line_of = [&](const std::string& label) {
      const size_t at = out.find(label);
      return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
    };
    EXPECT_NE(
        line_of("KV cache, bytes/token (int8, CPU)").find(absl::StrCat(" ", numbers + scales, " ")),
        std::string::npos)
        << out;
    EXPECT_NE(
        line_of("KV cache, bytes/token (bf16, CPU)").find(absl::StrCat(" ", 2 * numbers, " ")),
        std::string::npos)
        << out;
  }
  EXPECT_EQ(run(cli::cmd_inspect, {dir + "/nothing"}), 1);
  EXPECT_EQ(run(cli::cmd_inspect, {}), 2);
}

// A directory whose config.json is a FIFO is refused at once, as loading the checkpoint refuses
// it: inspect read it directly and waited for a writer for good.
TEST(InspectCommand, AConfigThatIsNoRegularFileIsRefused) {
  const std::string dir = fresh_dir() + "/fifo";
  std::filesystem::create_directories(dir);
  ASSERT_EQ(::mkfifo((dir + "/config.json").c_str(), 0600), 0);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run(cli::cmd_inspect, {dir}), 1);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("'" + dir + "/config.json' is not a regular file"), std::string::npos) << err;
}

}  // namespace
}  // namespace cemlm
