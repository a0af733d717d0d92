// `cemlm tokenizer`: the subcommand list, train → encode → decode through the command line, and
// bad flags named in the error output with the right exit code.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "cemlm/cli/commands.h"
#include "cemlm/engine/corpus.h"
#include "test_files.h"
#include "tokenizer_util.h"

namespace cemlm {
namespace {

struct CliRun {
  int rc;
  std::string out, err;
};

CliRun run(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  int rc = cli::cmd_tokenizer(int(argv.size()), argv.data());
  std::fflush(stdout);
  std::fflush(stderr);
  std::string out = ::testing::internal::GetCapturedStdout();
  return {rc, out, ::testing::internal::GetCapturedStderr()};
}

TEST(TokenizerCli, HelpListsSubcommands) {
  CliRun r = run({"--help"});
  EXPECT_EQ(r.rc, 0);
  for (const char* sub : {"train", "encode", "decode"})
    EXPECT_NE(r.out.find(sub), std::string::npos) << r.out;
  CliRun train_help = run({"train", "--help"});
  EXPECT_EQ(train_help.rc, 0);
  EXPECT_NE(train_help.out.find("--vocab-size"), std::string::npos) << train_help.out;
  EXPECT_EQ(run({}).rc, 2);
  EXPECT_EQ(run({"bogus"}).rc, 2);
}

TEST(TokenizerCli, TrainEncodeDecode) {
  const std::string dir = testing_files::fresh_temp_dir(), model = dir + "/tok.model";
  const auto corpus = testing_files::small_corpus();
  CliRun train =
      run({"train", "--input", corpus[0], corpus[1], "--vocab-size", "400", "--out", model});
  ASSERT_EQ(train.rc, 0) << train.err;
  EXPECT_TRUE(std::filesystem::exists(model));
  EXPECT_NE(train.out.find("2 text files"), std::string::npos) << train.out;

  // A training run's output under an --input directory is left out, and named.
  const std::string inputs = dir + "/inputs";
  std::filesystem::create_directories(inputs + "/old-run");
  std::filesystem::copy_file(corpus[0], inputs + "/a.txt");
  std::ofstream(inputs + "/old-run/trainer_state.json") << "{\"step\": 1}\n";
  CliRun skipping =
      run({"train", "--input", inputs, "--vocab-size", "400", "--out", dir + "/tok2.model"});
  ASSERT_EQ(skipping.rc, 0) << skipping.err;
  EXPECT_NE(skipping.out.find("from 1 text files"), std::string::npos) << skipping.out;
  EXPECT_NE(skipping.err.find("note: left out '" + inputs +
                              "/old-run': a training run's checkpoint or token cache"),
            std::string::npos)
      << skipping.err;
  // Named itself, it was read as a corpus: its JSON trained a tokenizer, exit 0.
  CliRun run_dir = run({"train", "--input", inputs + "/old-run", "--vocab-size", "400", "--out",
                        dir + "/tok3.model"});
  EXPECT_EQ(run_dir.rc, 1);
  EXPECT_NE(run_dir.err.find("input '" + inputs +
                             "/old-run' is a training run's checkpoint or token cache, not text"),
            std::string::npos)
      << run_dir.err;
  // A folder of nothing else says what it left out.
  std::filesystem::remove(inputs + "/a.txt");
  CliRun only_runs =
      run({"train", "--input", inputs, "--vocab-size", "400", "--out", dir + "/tok3.model"});
  EXPECT_EQ(only_runs.rc, 1);
  EXPECT_NE(only_runs.err.find("left out as training runs' checkpoints or token caches: '" +
                               inputs + "/old-run'"),
            std::string::npos)
      << only_runs.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/tok3.model"));

  const std::string text = "Fortune favours the bold, café 日本";
  CliRun enc = run({"encode", "--model", model, "--text", text});
  ASSERT_EQ(enc.rc, 0) << enc.err;
  ASSERT_TRUE(enc.out.ends_with("\n"));
  CliRun dec = run({"decode", "--model", model, "--ids", enc.out.substr(0, enc.out.size() - 1)});
  ASSERT_EQ(dec.rc, 0) << dec.err;
  EXPECT_EQ(dec.out, text + "\n");

  CliRun pieces = run({"encode", "--model", model, "--text", "a\n", "--pieces"});
  EXPECT_NE(pieces.out.find("<0x0A>"), std::string::npos) << pieces.out;

  // The empty text round-trips too: no ids, and no ids decode to an empty line.
  CliRun none = run({"encode", "--model", model, "--text", ""});
  ASSERT_EQ(none.rc, 0) << none.err;
  EXPECT_EQ(none.out, "\n");
  CliRun empty = run({"decode", "--model", model, "--ids", ""});
  ASSERT_EQ(empty.rc, 0) << empty.err;
  EXPECT_EQ(empty.out, "\n");
}

TEST(TokenizerCli, ErrorsNameTheFlag) {
  const std::string dir = testing_files::fresh_temp_dir(), model = dir + "/tok.model";
  EXPECT_EQ(run({"train", "--input", testing_files::small_corpus()[0]}).rc, 2);  // no --out
  // Below what any text needs: a usage error, before the --out check (the text's own need is
  // the text's: exit 1 below).
  for (const char* n : {"10", "0", "-5"}) {
    CliRun small = run({"train", "--input", testing_files::small_corpus()[0], "--vocab-size", n,
                        "--out", "/nonexistent/dir/tok.model"});
    EXPECT_EQ(small.rc, 2) << n;
    EXPECT_NE(small.err.find(std::string("--vocab-size ") + n + " is too small"), std::string::npos)
        << small.err;
  }
  // Above the fixed minimum but below what this text's characters need: said in our terms.
  std::string many_chars;
  for (int cp = 0x4E00; cp < 0x4E00 + 120; ++cp)  // 120 distinct CJK characters, 3 bytes each
    many_chars += {char(0xE0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3F)), char(0x80 | (cp & 0x3F))};
  testing_files::write_file(dir + "/cjk.txt", many_chars + "\n" + many_chars + "\n");
  CliRun few = run({"train", "--input", dir + "/cjk.txt", "--vocab-size", "300", "--out", model});
  EXPECT_EQ(few.rc, 1);
  EXPECT_NE(few.err.find("--vocab-size 300 is too small for this text"), std::string::npos)
      << few.err;
  EXPECT_NE(few.err.find("use at least"), std::string::npos) << few.err;
  // Blank text only: said so (SentencePiece failed without a reason, or asked for a smaller
  // vocabulary).
  testing_files::write_file(dir + "/blank/lines.txt", "\n\n\n");
  testing_files::write_file(dir + "/blank/spaces.txt", "   \t \n  \n");
  CliRun blank = run({"train", "--input", dir + "/blank", "--vocab-size", "300", "--out", model});
  EXPECT_EQ(blank.rc, 1);
  EXPECT_NE(blank.err.find("no text to train the tokenizer on: the inputs (--input) hold only "
                           "blank lines and spaces"),
            std::string::npos)
      << blank.err;
  CliRun missing = run({"decode", "--model", model, "--ids", "1,2"});
  EXPECT_EQ(missing.rc, 1);
  EXPECT_NE(missing.err.find(model), std::string::npos) << missing.err;
  CliRun bad_ids = run({"decode", "--model", model, "--ids", "1,x"});
  EXPECT_EQ(bad_ids.rc, 2);  // a usage error, as score's and grads' malformed --ids are
  EXPECT_NE(bad_ids.err.find("--ids"), std::string::npos) << bad_ids.err;
  CliRun negative = run({"decode", "--model", model, "--ids", "1,-2"});
  EXPECT_EQ(negative.rc, 2);  // no tokenizer has it
  EXPECT_NE(negative.err.find("--ids[1] = -2 is not a token id (ids are >= 0)"), std::string::npos)
      << negative.err;
  CliRun bad_text = run({"encode", "--model", model, "--text", "caf\xE9"});
  EXPECT_EQ(bad_text.rc, 2);  // a usage error, whatever the tokenizer
  EXPECT_NE(bad_text.err.find("--text is not valid UTF-8 (bad byte at offset 3)"),
            std::string::npos)
      << bad_text.err;
  // A text the tokenizer refuses: an error naming the flag, not an abort.
  const std::string refuses = dir + "/refuses.model";
  testing_files::write_file(refuses, testing_tokens::kRefusesSpaceX);
  CliRun refused = run({"encode", "--model", refuses, "--text", " x"});
  EXPECT_EQ(refused.rc, 1);
  EXPECT_NE(refused.err.find("--text: the tokenizer cannot encode this text"), std::string::npos)
      << refused.err;
}

TEST(TokenizerCli, BadOutPathFailsBeforeTraining) {
  // Training on this text would fail (--vocab-size too small for its characters): an --out that
  // cannot be written must be reported first, without training.
  const std::string dir = testing_files::fresh_temp_dir();
  std::string many_chars;
  for (int cp = 0x4E00; cp < 0x4E00 + 120; ++cp)
    many_chars += {char(0xE0 | (cp >> 12)), char(0x80 | ((cp >> 6) & 0x3F)), char(0x80 | (cp & 0x3F))};
  testing_files::write_file(dir + "/cjk.txt", many_chars + "\n" + many_chars + "\n");
  const auto train = [&](const std::string& out) {
    return run({"train", "--input", dir + "/cjk.txt", "--vocab-size", "300", "--out", out});
  };
  CliRun is_dir = train(dir);
  EXPECT_EQ(is_dir.rc, 1);
  EXPECT_NE(is_dir.err.find("--out '" + dir + "' is a directory"), std::string::npos) << is_dir.err;
  EXPECT_NE(is_dir.err.find(dir + "/tokenizer.model"), std::string::npos) << is_dir.err;
  CliRun trailing = train(dir + "/sub/");
  EXPECT_EQ(trailing.rc, 1);
  EXPECT_NE(trailing.err.find("is a directory"), std::string::npos) << trailing.err;
  testing_files::write_file(dir + "/file", "x");
  CliRun under_file = train(dir + "/file/deeper/tok.model");
  EXPECT_EQ(under_file.rc, 1);
  EXPECT_NE(under_file.err.find("'" + dir + "/file' is not a directory"), std::string::npos)
      << under_file.err;
  EXPECT_EQ(under_file.err.find("--vocab-size"), std::string::npos) << under_file.err;
  // Missing directories are fine (the write creates them): training runs, and fails on its own.
  CliRun missing_dirs = train(dir + "/new/deeper/tok.model");
  EXPECT_EQ(missing_dirs.rc, 1);
  EXPECT_NE(missing_dirs.err.find("--vocab-size 300 is too small"), std::string::npos)
      << missing_dirs.err;
  EXPECT_FALSE(std::filesystem::exists(dir + "/new")) << "the check must not create directories";
}

// A trained checkpoint's tokenizer is not replaced (a new one fed its weights other ids, and one
// of as many pieces loaded without a word); a checkpoint without one may get one.
TEST(TokenizerCli, ACheckpointsTokenizerIsNotReplaced) {
  const std::string dir = testing_files::fresh_temp_dir(), ck = dir + "/ck";
  const auto corpus = testing_files::small_corpus();
  testing_files::write_file(ck + "/config.json", "{}");
  const auto train = [&](const std::string& out) {
    return run({"train", "--input", corpus[0], "--vocab-size", "400", "--out", out});
  };
  ASSERT_EQ(train(ck + "/tokenizer.model").rc, 0);  // none there yet
  CliRun again = train(ck + "/tokenizer.model");
  EXPECT_EQ(again.rc, 1);
  EXPECT_NE(again.err.find("is the tokenizer of the checkpoint beside it"), std::string::npos)
      << again.err;
  std::filesystem::create_symlink(ck + "/tokenizer.model", dir + "/link.model");
  CliRun through_link = train(dir + "/link.model");  // the write lands in the checkpoint
  EXPECT_EQ(through_link.rc, 1);
  EXPECT_NE(through_link.err.find("is the tokenizer of the checkpoint beside it"),
            std::string::npos)
      << through_link.err;
  EXPECT_EQ(run({"train", "--input", corpus[0], "--vocab-size", "400", "--threads", "-1", "--out",
                 dir + "/t.model"})
                .rc,
            2);
}

// --threads sets SentencePiece's trainer threads, which the model file records: the same text
// and threads give the same bytes, and `cemlm train` uses its own --threads (it trained on every
// CPU whatever it was given).
TEST(TokenizerCli, ThreadsAreTheOnesGiven) {
  const std::string dir = testing_files::fresh_temp_dir();
  const auto corpus = testing_files::small_corpus();
  std::string one, again, two, error;
  for (auto [threads, bytes] : {std::pair{"1", &one}, {"1", &again}, {"2", &two}}) {
    const std::string out = dir + "/t" + threads + ".model";
    std::filesystem::remove(out);
    ASSERT_EQ(run({"train", "--input", corpus[0], "--vocab-size", "400", "--threads", threads,
                   "--out", out})
                  .rc,
              0);
    ASSERT_TRUE(read_file(out, bytes, &error)) << error;
  }
  EXPECT_EQ(one, again);
  EXPECT_NE(one, two);
  // More than SentencePiece takes (128) trains on 128: it failed "with no reason".
  EXPECT_EQ(run({"train", "--input", corpus[0], "--vocab-size", "400", "--threads", "129", "--out",
                 dir + "/t129.model"})
                .rc,
            0);
}

}  // namespace
}  // namespace cemlm
