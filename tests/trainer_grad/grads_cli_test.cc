// `cemlm grads` end to end: the written file holds every parameter's gradient under its name and
// `loss` [1], equal to forward_backward's; bad flags and inputs are refused with errors naming
// them.
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "cemlm/cli/commands.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/trainer/backprop.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "temp_dir.h"
#include "tiny_models.h"

namespace cemlm {
namespace {

namespace fs = std::filesystem;

class GradsCli : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing_temp::fresh_dir("grads_cli");
    cfg_ = testing_models::make_config(testing_models::all_variants()[5]);
    cfg_.recursion_default = 2;
    cfg_.recursion_max = 4;
    params_ = ParamStore(cfg_);
    testing_models::randomize(params_, 3);
    ASSERT_TRUE(save_checkpoint(model_dir(), cfg_, params_).ok());
  }
  std::string model_dir() const { return (dir_ / "model").string(); }
  std::string out_file() const { return (dir_ / "grads.safetensors").string(); }

  // Runs `cemlm grads ARGS`; returns the exit code, stderr in *err, stdout in *out.
  int run(std::vector<std::string> args, std::string* err = nullptr, std::string* out = nullptr) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    testing::internal::CaptureStderr();
    testing::internal::CaptureStdout();
    const int rc = cli::cmd_grads(int(argv.size()), argv.data());
    const std::string e = testing::internal::GetCapturedStderr();
    const std::string o = testing::internal::GetCapturedStdout();
    if (err) *err = e;
    if (out) *out = o;
    return rc;
  }

  fs::path dir_;
  ModelConfig cfg_;
  ParamStore params_;
};

TEST_F(GradsCli, WritesEveryGradientAndTheLoss) {
  ASSERT_EQ(run({"--model", model_dir(), "--ids", "3,17,42,5,9,60", "--recursion", "3", "--out",
                 out_file()}),
            0);
  ParamStore expected(cfg_);
  const std::vector<int> ids{3, 17, 42, 5, 9, 60};
  const double loss =
      forward_backward(cfg_, bind_weights(cfg_, params_), bind_weights(cfg_, expected), ids.data(),
                       1, int(ids.size()), 3);
  auto f = SafetensorsFile::open(out_file());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tensors().size(), expected.specs().size() + 1);
  for (const ParamSpec& s : expected.specs()) {
    const TensorInfo* t = f->find(s.name);
    ASSERT_NE(t, nullptr) << s.name;
    EXPECT_EQ(t->shape, s.shape) << s.name;
    const std::vector<float> got = *f->read_f32(s.name);
    const std::vector<float> want(expected.flat().begin() + s.offset,
                                  expected.flat().begin() + s.offset + s.numel());
    EXPECT_EQ(got, want) << s.name;
  }
  ASSERT_NE(f->find("loss"), nullptr);
  EXPECT_EQ(f->find("loss")->shape, std::vector<int64_t>{1});
  EXPECT_FLOAT_EQ((*f->read_f32("loss"))[0], float(loss));
}

TEST_F(GradsCli, DefaultRecursionIsTheModels) {
  ASSERT_EQ(run({"--model", model_dir(), "--ids", "3,17,42", "--out", out_file()}), 0);
  ParamStore expected(cfg_);
  const std::vector<int> ids{3, 17, 42};
  const double loss =
      forward_backward(cfg_, bind_weights(cfg_, params_), bind_weights(cfg_, expected), ids.data(),
                       1, 3, cfg_.recursion_default);
  auto f = SafetensorsFile::open(out_file());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FLOAT_EQ((*f->read_f32("loss"))[0], float(loss));
}

TEST_F(GradsCli, HelpSucceeds) { EXPECT_EQ(run({"--help"}), 0); }

struct BadCase {
  std::vector<std::string> args;  // besides --model/--out, which are filled in unless absent
  std::string names;              // the error must contain this
  int rc = 1;                     // 2: a usage error, whatever the model
};

// "3,3,…": `n` ids.
std::string ids_of_length(int n) {
  std::string ids = "3";
  for (int i = 1; i < n; ++i) ids += ",3";
  return ids;
}

TEST_F(GradsCli, BadInputsAreRefusedByName) {
  const std::vector<BadCase> cases = {
      {{"--ids", "3,x,5"}, "--ids: expected comma-separated integers", 2},
      // One id has no next token to score, whatever the model: a usage error (it exited 1).
      {{"--ids", "3"}, "--ids: need at least 2 tokens (got 1)", 2},
      {{"--ids", "3,61"}, "--ids[1] = 61 is not a token id in [0, 61)"},
      {{"--ids", ids_of_length(65)}, "--ids has 65 tokens; the model's max_seq_len is 64"},
      {{"--ids", "3,-1"}, "--ids[1] = -1 is not a token id", 2},
      {{"--ids", "3,4", "--recursion", "5"},
       "--recursion = 5 exceeds the model's recursion.max = 4"},
      // 0 is a depth too (the model's default): the range says so, as score's and generate's do.
      {{"--ids", "3,4", "--threads", "-1"}, "--threads -1 must be >= 0 and at most 1024", 2},
      {{"--ids", "3,4", "--threads", "2000"}, "--threads 2000 must be >= 0 and at most 1024", 2},
      {{"--ids", "3,4", "--recursion", "-1"},
       "--recursion = -1 must be >= 0 (0 = the model's recursion.default)",
       2},
  };
  for (const BadCase& bc : cases) {
    std::vector<std::string> args{"--model", model_dir(), "--out", out_file()};
    args.insert(args.end(), bc.args.begin(), bc.args.end());
    std::string err;
    EXPECT_EQ(run(args, &err), bc.rc) << bc.args[1];
    EXPECT_NE(err.find(bc.names), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(out_file()));
  }
}

// An --out it cannot write is refused by name before the forward and backward run.
TEST_F(GradsCli, AnOutThatIsADirectoryIsRefusedFirst) {
  const std::string dir = fs::path(out_file()).parent_path().string();
  std::string err;
  EXPECT_EQ(run({"--model", model_dir(), "--ids", "3,4", "--out", dir + "/"}, &err), 1);
  EXPECT_NE(err.find("--out '" + dir + "/' is a directory; name the file to write, like " + dir +
                     "/grads.safetensors"),
            std::string::npos)
      << err;
  EXPECT_EQ(run({"--model", model_dir(), "--ids", "3,4", "--out", dir + "/no/such/dir/g.st"}, &err),
            1);
  EXPECT_NE(err.find("does not exist"), std::string::npos) << err;
}

// --out naming one of the checkpoint's own files is refused before anything is written: it
// replaced the weights (or the config) with the gradients, and the checkpoint no longer loaded.
TEST_F(GradsCli, AnOutThatIsACheckpointFileIsRefused) {
  for (const char* file : {"model.safetensors", "config.json"}) {
    const std::string target = model_dir() + "/" + file;
    const uintmax_t size = fs::file_size(target);
    std::string err;
    EXPECT_EQ(run({"--model", model_dir(), "--ids", "3,4", "--out", target}, &err), 1) << file;
    EXPECT_NE(err.find("is an input of this command"), std::string::npos) << err;
    EXPECT_EQ(fs::file_size(target), size) << file;
  }
  // Also one the checkpoint does not have yet: written, a tokenizer.model of gradients made it
  // one that no longer loads.
  ASSERT_FALSE(fs::exists(model_dir() + "/tokenizer.model"));
  std::string err;
  EXPECT_EQ(run({"--model", model_dir(), "--ids", "3,4", "--out", model_dir() + "/tokenizer.model"},
                &err),
            1);
  EXPECT_NE(err.find("is an input of this command"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(model_dir() + "/tokenizer.model"));
  EXPECT_TRUE(load_checkpoint(model_dir()).ok());
  // Nor a file of another checkpoint, or a link to one: its weights were replaced by gradients,
  // and that checkpoint no longer loaded.
  const std::string other = (dir_ / "other").string();
  ASSERT_TRUE(save_checkpoint(other, cfg_, params_).ok());
  fs::create_symlink(other + "/model.safetensors", dir_ / "link.safetensors");
  for (const std::string& target : {other + "/model.safetensors", other + "/trainer_state.json",
                                    (dir_ / "link.safetensors").string()}) {
    EXPECT_EQ(run({"--model", model_dir(), "--ids", "3,4", "--out", target}, &err), 1) << target;
    EXPECT_NE(err.find("--out '" + target + "' is a file of the checkpoint '" + other +
                       "': writing it would break that checkpoint"),
              std::string::npos)
        << err;
  }
  EXPECT_FALSE(fs::exists(other + "/trainer_state.json"));
  EXPECT_TRUE(load_checkpoint(other).ok());
  // Another file there is no input: written again and again (the directory's listing was taken
  // for the inputs, so a second run refused the first one's output).
  const std::string beside = model_dir() + "/grads.safetensors";
  EXPECT_EQ(run({"--model", model_dir(), "--ids", "3,4", "--out", beside}), 0);
  EXPECT_EQ(run({"--model", model_dir(), "--ids", "3,4", "--out", beside}, &err), 0) << err;
}

TEST_F(GradsCli, MissingFlagsAndModelAreNamed) {
  std::string err;
  EXPECT_NE(run({"--model", model_dir(), "--ids", "3,4"}, &err), 0);
  EXPECT_NE(err.find("out"), std::string::npos) << err;
  EXPECT_NE(run({"--ids", "3,4", "--out", out_file()}, &err), 0);
  EXPECT_NE(err.find("model"), std::string::npos) << err;
  const std::string missing = (dir_ / "no_such_model").string();
  EXPECT_NE(run({"--model", missing, "--ids", "3,4", "--out", out_file()}, &err), 0);
  EXPECT_NE(err.find("no_such_model"), std::string::npos) << err;
}

// A model whose forward or backward overflows 32-bit floats is refused, as `cemlm score` refuses
// it, rather than written out as NaN/inf gradients with exit status 0.
TEST_F(GradsCli, NonFiniteLossOrGradientIsRefusedAndNothingWritten) {
  ModelConfig cfg = testing_models::make_config(testing_models::all_variants()[3]);  // a table
  ParamStore params(cfg);
  testing_models::randomize(params, 3);
  ParamStore infinite_logits = params;
  testing_models::scale_param(infinite_logits, "final_norm.weight", 1e20f);
  testing_models::scale_param(infinite_logits, "lm_head.weight", 1e30f);
  const std::string infinite_dir = (dir_ / "infinite").string();
  ASSERT_TRUE(save_checkpoint(infinite_dir, cfg, infinite_logits).ok());
  testing_models::overflow_the_backward(cfg, params);  // the loss stays finite
  const std::string overflow_dir = (dir_ / "overflow").string();
  ASSERT_TRUE(save_checkpoint(overflow_dir, cfg, params).ok());

  for (const auto& [dir, says] : std::vector<std::pair<std::string, std::string>>{
           {infinite_dir, "the loss is not finite"},
           {overflow_dir, "the gradient of 'embed.weight' is not finite"}}) {
    std::string err;
    EXPECT_EQ(run({"--model", dir, "--ids", "3,17,42,5,9,60", "--out", out_file()}, &err), 1)
        << says;
    EXPECT_NE(err.find(says), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(out_file())) << says;
  }
}

TEST_F(GradsCli, UnwritableOutputIsNamed) {
  std::string err;
  const std::string bad = (dir_ / "no_dir" / "g.safetensors").string();
  EXPECT_NE(run({"--model", model_dir(), "--ids", "3,4", "--out", bad}, &err), 0);
  EXPECT_NE(err.find("--out"), std::string::npos) << err;
}

// A file name need not be UTF-8 on Linux, but JSON text must be: the summary line named such an
// --out with nlohmann's strict dump, which threw after the file was written and aborted the
// process (SIGABRT, exit 134). The name is printed with U+FFFD for the bytes JSON cannot hold.
TEST_F(GradsCli, OutPathThatIsNotUtf8IsWrittenAndPrinted) {
  const std::string latin1 = (dir_ /
                              "gr\xe4"
                              "ds.safetensors")
                                 .string();
  std::string err, out;
  ASSERT_EQ(run({"--model", model_dir(), "--ids", "3,4,5", "--out", latin1}, &err, &out), 0) << err;
  EXPECT_TRUE(fs::exists(latin1));
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["out"], (dir_ / "gr\xef\xbf\xbd"
                              "ds.safetensors")
                          .string());
  EXPECT_EQ(j["tokens"], 3);
}

}  // namespace
}  // namespace cemlm
