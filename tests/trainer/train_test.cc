// The training loop end to end on a tiny model: the loss falls, a stopped-and-resumed run
// reproduces the uninterrupted one bit for bit, accumulation equals a bigger batch, checkpoints
// are complete and atomic, and every bad flag is refused by name.
#include "cemlm/trainer/train.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cemlm/cli/commands.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/corpus.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/engine/tokenizer.h"
#include "cemlm/trainer/backprop.h"
#include "cemlm/trainer/data.h"
#include "nlohmann/json.hpp"
#include "tiny_models.h"
#include "trainer_test_util.h"

namespace cemlm {
namespace {

namespace fs = std::filesystem;
using testing_trainer::fresh_dir;
using testing_trainer::tiny_options;

struct Recorded {
  std::vector<StepMetrics> steps;
  std::vector<EvalMetrics> evals;
  TrainSummary summary;
};

// Trains with `o`, recording every step; stops (cleanly) after `stop_at` steps when > 0.
Recorded record(const TrainOptions& o, int64_t stop_at = 0) {
  Recorded r;
  TrainCallbacks cb;
  cb.on_step = [&](const StepMetrics& m) {
    r.steps.push_back(m);
    return stop_at == 0 || m.step < stop_at;
  };
  cb.on_eval = [&](const EvalMetrics& e) { r.evals.push_back(e); };
  auto s = train(o, cb);
  EXPECT_TRUE(s.ok()) << s.status();
  if (s.ok()) r.summary = *s;
  return r;
}

std::vector<float> weights_of(const std::string& dir) {
  auto ck = load_checkpoint(dir);
  EXPECT_TRUE(ck.ok()) << ck.status();
  if (!ck.ok()) return {};
  return std::vector<float>(ck->params.flat().begin(), ck->params.flat().end());
}

TEST(Train, LossFallsOnATinyCorpus) {
  TrainOptions o = tiny_options(fresh_dir());
  o.steps = 40;
  o.eval_every = 40;
  const Recorded r = record(o);
  ASSERT_EQ(r.steps.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += r.steps[i].loss, last += r.steps[35 + i].loss;
  EXPECT_LT(last, first - 5 * 0.5)
      << "mean loss of the first 5 steps " << first / 5 << ", of the last 5 " << last / 5;
  ASSERT_EQ(r.evals.size(), 1u);
  EXPECT_EQ(r.evals[0].loss.size(), 2u);  // T = 1 and 2
  EXPECT_LT(r.evals[0].loss[0].second, std::log(300.0));
  EXPECT_TRUE(r.summary.finished);
}

TEST(Train, StoppedAndResumedRunMatchesTheUninterruptedOneBitExactly) {
  const std::string dir = fresh_dir();
  TrainOptions straight = tiny_options(dir + "/a");
  const Recorded full = record(straight);
  ASSERT_EQ(full.steps.size(), 12u);

  TrainOptions halves = tiny_options(dir + "/b");
  const Recorded first = record(halves, 5);
  ASSERT_EQ(first.steps.size(), 5u);
  EXPECT_FALSE(first.summary.finished);
  halves.resume = true;
  const Recorded second = record(halves);
  ASSERT_EQ(second.steps.size(), 7u);
  EXPECT_TRUE(second.summary.finished);

  std::vector<double> a, b;
  for (const auto& m : full.steps) a.push_back(m.loss);
  for (const auto* r : {&first, &second})
    for (const auto& m : r->steps) b.push_back(m.loss);
  EXPECT_EQ(a, b);  // exactly, not approximately
  for (size_t i = 0; i < full.steps.size(); ++i) {
    const StepMetrics& x = full.steps[i];
    const StepMetrics& y = i < 5 ? first.steps[i] : second.steps[i - 5];
    EXPECT_EQ(x.T, y.T) << "step " << i + 1;
    EXPECT_EQ(x.grad_norm, y.grad_norm) << "step " << i + 1;
    EXPECT_EQ(x.tokens, y.tokens);
  }
  EXPECT_EQ(weights_of(straight.out_dir), weights_of(halves.out_dir));
  EXPECT_EQ(full.evals.back().loss, second.evals.back().loss);
  // The resumed run's log continues the first half's: every step once.
  std::string log, error;
  ASSERT_TRUE(read_file(halves.out_dir + "/" + kMetricsFile, &log, &error)) << error;
  auto parsed = MetricsLog::parse(log, "train.jsonl");
  ASSERT_TRUE(parsed.ok());
  ASSERT_EQ(parsed->steps().size(), 12u);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(parsed->steps()[i].loss, a[i]);
}

// A resumed run whose options differ from the ones it saved (flags given again with other values)
// says which, and from what to what: it goes on with them, and no longer continues as it would
// have. The time budget changes no result and is not named; the thread count can change the last
// bits (OpenBLAS splits large products over the threads) and is named.
TEST(Train, ResumeWithChangedOptionsNamesThem) {
  TrainOptions o = tiny_options(fresh_dir());
  o.steps = 4;
  record(o, 2);
  auto resume_saying = [&](const TrainOptions& opts) {
    std::string lines;
    TrainCallbacks cb;
    cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
    cb.on_step = [](const StepMetrics& m) { return m.step < 3; };
    EXPECT_TRUE(train(opts, cb).ok());
    return lines;
  };
  o.resume = true;
  o.max_minutes = 10;
  // The same paths written with a trailing separator are the same options.
  for (std::string& d : o.data) d += "/";
  std::string said = resume_saying(o);
  EXPECT_EQ(said.find("differ"), std::string::npos) << said;
  EXPECT_EQ(said.find("learning rate"), std::string::npos) << said;
  o.threads = 2;
  o.steps = 6;
  o.lr = 5e-3;
  o.train_recursion = {2, 2};
  said = resume_saying(o);
  EXPECT_NE(said.find("note: resuming with options that differ from the run's: --lr 0.01 → 0.005, "
                      "--steps 4 → 6, --threads 1 → 2, --train-recursion 1-3 → 2;"),
            std::string::npos)
      << said;
  EXPECT_EQ(said.find("--max-minutes"), std::string::npos) << said;
  // The learning rate's jump (the schedule spans --steps, and --lr changed) is said with it.
  EXPECT_NE(said.find("note: at step 3 the learning rate is now "), std::string::npos) << said;
  EXPECT_NE(said.find("on the run's schedule), since the schedule spans --steps 6"),
            std::string::npos)
      << said;
}

// A stop asked for during an evaluation ends the run at that step, saved: it trained one more
// step, evaluated again and only then saved (twice the evaluation's time past the signal). One
// asked for during a save ends it there, the save being the run's last.
TEST(Train, AStopDuringAnEvaluationOrASaveEndsTheRunThere) {
  // During an evaluation (on a step that saves as well, and on one that does not), and a save.
  for (const auto& [during_save, save_every] : {std::pair{false, 100}, {false, 6}, {true, 4}}) {
    TrainOptions o = tiny_options(fresh_dir());  // 12 steps, an evaluation every 6
    o.save_every = save_every;
    if (during_save) o.eval_every = 100;
    int evaluations = 0, saves = 0, asked = 0;
    int64_t last_step = 0;
    TrainCallbacks cb;
    cb.on_step = [&](const StepMetrics& m) { return last_step = m.step, true; };
    cb.on_eval = [&](const EvalMetrics&) { ++evaluations; };
    cb.on_save = [&](int64_t, const std::string&) { ++saves; };
    cb.stop_after = [&](int64_t step, bool saved) {
      ++asked;
      return saved == during_save && step == (during_save ? 4 : 6);
    };
    auto summary = train(o, cb);
    ASSERT_TRUE(summary.ok()) << summary.status();
    EXPECT_EQ(summary->step, during_save ? 4 : 6) << during_save;
    EXPECT_EQ(last_step, summary->step) << "no step after the stop";
    EXPECT_FALSE(summary->finished);
    EXPECT_EQ(evaluations, during_save ? 0 : 1) << during_save;
    EXPECT_EQ(saves, 1) << during_save << " " << save_every;  // one, the stop's
    EXPECT_GE(asked, 1);
    std::string text, error;
    ASSERT_TRUE(read_file(o.out_dir + "/" + kTrainerStateFile, &text, &error)) << error;
    EXPECT_EQ(nlohmann::json::parse(text)["step"], summary->step) << during_save;
  }
}

// With --threads 0 the count comes from OMP_NUM_THREADS or the CPUs, so the same flags on another
// machine run on another count, whose products split their sums otherwise: the state saves the
// count the run had, and a resume on another says that it is no longer bit-exact. (The count is
// edited in the state here: OpenMP reads OMP_NUM_THREADS once per process.)
TEST(Train, ResumeOnAnotherThreadCountSaysSo) {
  TrainOptions o = tiny_options(fresh_dir());  // --threads 1
  o.steps = 4;
  record(o, 2);
  const std::string state_path = o.out_dir + "/" + kTrainerStateFile;
  auto state = [&] {
    std::string text, error;
    EXPECT_TRUE(read_file(state_path, &text, &error)) << error;
    return nlohmann::json::parse(text);
  };
  EXPECT_EQ(state()["compute_threads"], 1);
  auto resume_saying = [&] {
    std::string lines;
    TrainCallbacks cb;
    cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
    cb.on_step = [](const StepMetrics& m) { return m.step < 3; };
    TrainOptions r = o;
    r.resume = true;
    EXPECT_TRUE(train(r, cb).ok());
    return lines;
  };
  std::string said = resume_saying();
  EXPECT_EQ(said.find("compute threads where"), std::string::npos) << said;
  nlohmann::json edited = state();
  edited["compute_threads"] = 6;
  testing_trainer::write_file(state_path, edited.dump());
  said = resume_saying();
  EXPECT_NE(said.find("note: resuming on 1 compute threads where the run had 6: products split "
                      "their sums otherwise, so the run no longer matches an uninterrupted one "
                      "bit for bit (--threads 6 keeps it)"),
            std::string::npos)
      << said;
  EXPECT_EQ(said.find("options that differ"), std::string::npos) << said;  // the flags are equal
  // A count that is no thread count is a damaged state, named.
  edited["compute_threads"] = 0;
  testing_trainer::write_file(state_path, edited.dump());
  TrainOptions r = o;
  r.resume = true;
  const auto refused = train(r, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find(
                "\"compute_threads\": must be an integer of at least 1 (got 0)"),
            std::string::npos)
      << refused.status();
}

// --train-recursion MIN-MAX draws every depth of the range, both ends included.
// A run whose T varies lays out a step's working memory at its largest T before the first step:
// a later step at a larger T than those before it took more (its takes skipped chunks laid out
// for a smaller T), up to a fifth more, and a run that fit at its largest T was refused there.
TEST(Train, AVaryingDepthTakesItsWorkingMemoryOnceBeforeTheFirstStep) {
  TrainOptions o = tiny_options(fresh_dir());
  o.train_recursion = {1, 4};
  o.steps = 8;
  o.seed = 7;
  o.batch_size = 256;  // 16,384 rows: a step's memory spans several 16 MiB chunks
  o.seq_len = 64;
  std::vector<int64_t> held;
  std::vector<int> depths;
  TrainCallbacks cb;
  cb.on_step = [&](const StepMetrics& m) {
    held.push_back(forward_backward_held_bytes());
    depths.push_back(m.T);
    return true;
  };
  ASSERT_TRUE(train(o, cb).ok());
  ASSERT_EQ(held.size(), 8u);
  // The draws climb past the first step's T (else this run tells nothing).
  ASSERT_LT(depths[0], *std::max_element(depths.begin(), depths.end()));
  for (size_t i = 1; i < held.size(); ++i)
    EXPECT_EQ(held[i], held[0]) << "step " << i + 1 << " at T " << depths[i];
}

TEST(Train, TrainingDepthsCoverTheirWholeRange) {
  TrainOptions o = tiny_options(fresh_dir());
  o.steps = 30;
  o.eval_every = 100;
  o.train_recursion = {1, 3};
  std::set<int> seen;
  TrainCallbacks cb;
  cb.on_step = [&](const StepMetrics& m) { return seen.insert(m.T), true; };
  ASSERT_TRUE(train(o, cb).ok());
  EXPECT_EQ(seen, (std::set<int>{1, 2, 3}));
}

// A model trained at depths that leave out its recursion.default is served at a T it never
// trained at by the requests that leave T unset: the run says so.
TEST(Train, TrainingAwayFromTheDefaultDepthSaysSo) {
  auto said_for = [](RecursionRange r) {
    TrainOptions o = tiny_options(fresh_dir());  // recursion.default 2
    o.steps = 1;
    o.train_recursion = r;
    std::string lines;
    TrainCallbacks cb;
    cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
    EXPECT_TRUE(train(o, cb).ok());
    return lines;
  };
  for (RecursionRange inside : {RecursionRange{2, 2}, RecursionRange{1, 3}})
    EXPECT_EQ(said_for(inside).find("recursion.default"), std::string::npos);
  const std::string said = said_for({3, 4});
  EXPECT_NE(said.find("note: the model's recursion.default is 2, outside the T 3-4 it is trained "
                      "at: requests that leave T unset will run at 2"),
            std::string::npos)
      << said;
}

// A --data file with a stray non-UTF-8 byte trains on nothing of it: the run says so, naming the
// file and the byte (it said only "data: 2 files"), and trains on the rest.
TEST(Train, DataFilesLeftOutForTheirContentsAreNamed) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 1;
  testing_trainer::write_file(dir + "/text/notes.txt", "na\xefve text\n");
  std::string lines;
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
  ASSERT_TRUE(train(o, cb).ok());
  EXPECT_NE(lines.find("note: --data: 1 file left out: '" + dir +
                       "/text/notes.txt' is not UTF-8 text: invalid UTF-8 at byte offset 2"),
            std::string::npos)
      << lines;
  EXPECT_NE(lines.find("(convert a text file to UTF-8, e.g. with iconv"), std::string::npos)
      << lines;
  EXPECT_NE(lines.find("data: 2 files"), std::string::npos) << lines;
  // A FIFO is left out too, named, without the advice to convert it.
  fs::remove(dir + "/text/notes.txt");
  ASSERT_EQ(::mkfifo((dir + "/text/pipe.txt").c_str(), 0644), 0);
  o.out_dir = dir + "/run2";
  lines.clear();
  ASSERT_TRUE(train(o, cb).ok());
  EXPECT_NE(lines.find("note: --data: 1 file left out: '" + dir +
                       "/text/pipe.txt' is not a regular file"),
            std::string::npos)
      << lines;
  EXPECT_EQ(lines.find("iconv"), std::string::npos) << lines;
}

// Another run's checkpoint under --data is left out, and the run names it (its JSON and SVG were
// trained on as text).
TEST(Train, AnotherRunsCheckpointUnderDataIsLeftOutAndNamed) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 1;
  testing_trainer::write_file(dir + "/text/old/trainer_state.json", "{\"step\": 1}\n");
  testing_trainer::write_file(dir + "/text/old/train.jsonl", "{\"step\": 1}\n");
  std::string lines;
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
  ASSERT_TRUE(train(o, cb).ok());
  EXPECT_NE(lines.find("note: --data: 1 directory of another run's checkpoint or token cache left "
                       "out: " +
                       dir + "/text/old ("),
            std::string::npos)
      << lines;
  EXPECT_NE(lines.find("data: 2 files"), std::string::npos) << lines;
}

// The tokenizer trains on the data's files: with --cache inside --data, it collected --data again
// and took in the cache's tokenizer.key (a text file) that the data leaves out.
TEST(Train, TheTokenizerTrainsOnTheDataFilesOnly) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 1;
  o.cache_dir = dir + "/text/cache";
  ASSERT_TRUE(train(o, {}).ok());
  ASSERT_TRUE(fs::exists(dir + "/text/cache/tokenizer.key"));
  // A new file changes the data's key: the next run trains a tokenizer again, into that cache.
  testing_trainer::write_file(dir + "/text/c.txt", testing_trainer::corpus_text(100, 3));
  o.out_dir = dir + "/run2";
  std::string lines;
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
  ASSERT_TRUE(train(o, cb).ok());
  EXPECT_NE(lines.find("tokenizer: training "), std::string::npos) << lines;
  EXPECT_NE(lines.find("tokenizer: trained on 3 files"), std::string::npos) << lines;
  EXPECT_NE(lines.find("data: 3 files"), std::string::npos) << lines;
}

// The tokenizer's errors name `cemlm train`'s flags: they named `cemlm tokenizer train`'s
// --input (no such flag here) and --out (another directory here) for --data and --cache.
TEST(Train, TokenizerErrorsNameTheTrainersFlags) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  testing_trainer::write_file(dir + "/blank/a.txt", "\n  \n");
  o.data = {dir + "/blank"};
  auto s = train(o, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("the inputs (--data) hold only blank lines"),
            std::string::npos)
      << s.status();
  o = tiny_options(dir);
  o.cache_dir = dir + "/config.json/cache";  // under a file: cannot be created
  s = train(o, {});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("/config.json/cache/tokenizer.model' (--cache): "),
            std::string::npos)
      << s.status();
  EXPECT_EQ(s.status().message().find("--out"), std::string::npos) << s.status();
}

TEST(Train, AccumulatingTwoBatchesOfOneEqualsOneBatchOfTwo) {
  const std::string dir = fresh_dir();
  TrainOptions big = tiny_options(dir + "/big");
  big.steps = 4;
  big.batch_size = 2;
  TrainOptions acc = tiny_options(dir + "/acc");
  acc.steps = 4;
  acc.batch_size = 1;
  acc.accum = 2;
  const Recorded x = record(big), y = record(acc);
  ASSERT_EQ(x.steps.size(), 4u);
  ASSERT_EQ(y.steps.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_NEAR(x.steps[i].loss, y.steps[i].loss, 1e-5) << "step " << i + 1;
    EXPECT_NEAR(x.steps[i].grad_norm, y.steps[i].grad_norm, 1e-4 * x.steps[i].grad_norm);
    EXPECT_EQ(x.steps[i].tokens, y.steps[i].tokens);
  }
  const auto wx = weights_of(big.out_dir), wy = weights_of(acc.out_dir);
  ASSERT_EQ(wx.size(), wy.size());
  for (size_t i = 0; i < wx.size(); ++i) ASSERT_NEAR(wx[i], wy[i], 1e-5) << "weight " << i;
}

TEST(Train, CheckpointHoldsModelOptimizerStateAndMetricsWithNoLeftovers) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.out_dir += "/";  // the cache still goes beside the checkpoint, not into it
  o.save_every = 5;
  std::vector<int64_t> saves;
  TrainCallbacks cb;
  cb.on_save = [&](int64_t step, const std::string&) { saves.push_back(step); };
  ASSERT_TRUE(train(o, cb).ok());
  EXPECT_EQ(saves, (std::vector<int64_t>{5, 10, 12}));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(o.out_dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"config.json", "loss.svg", "model.safetensors",
                                             "optimizer.safetensors", "tokenizer.model",
                                             "train.jsonl", "trainer_state.json"}));
  std::vector<std::string> siblings;
  for (const auto& e : fs::directory_iterator(dir)) siblings.push_back(e.path().filename());
  std::sort(siblings.begin(), siblings.end());
  EXPECT_EQ(siblings,  // with the lock of --out, kept for the next run (see Trainer::lock_out)
            (std::vector<std::string>{".run.lock", "config.json", "run", "run.cache", "text"}));
  auto ck = load_checkpoint(o.out_dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_FALSE(ck->tokenizer_path.empty());
  auto saved = load_run_options(o.out_dir);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(options_to_json(*saved), options_to_json(o));
}

TEST(Train, LeftoverOfAnInterruptedSaveIsRemovedAndTheCheckpointStillLoads) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 3;
  ASSERT_TRUE(train(o).ok());
  // What a process killed inside save_checkpoint leaves: a half-written temporary directory.
  testing_trainer::write_file(o.out_dir + ".tmp-99999-0/model.safetensors", "half");
  // Not a save's: named otherwise after the prefix. Such a directory is the user's, and stays.
  for (const char* other : {".tmp-backup", ".tmp-1", ".tmp-1-", ".tmp--1", ".tmp-1-2-3"})
    testing_trainer::write_file(o.out_dir + other + "/keep.txt", "mine");
  EXPECT_TRUE(load_checkpoint(o.out_dir).ok());
  o.resume = true;
  o.steps = 5;
  ASSERT_TRUE(train(o).ok());
  EXPECT_FALSE(fs::exists(o.out_dir + ".tmp-99999-0"));
  for (const char* other : {".tmp-backup", ".tmp-1", ".tmp-1-", ".tmp--1", ".tmp-1-2-3"})
    EXPECT_TRUE(fs::exists(o.out_dir + other + "/keep.txt")) << other;
  EXPECT_TRUE(load_checkpoint(o.out_dir).ok());
}

// On a file system that cannot swap two directories in one rename (NFS), a save moves the old
// checkpoint aside to "<out>.tmp-<pid>-<n>.old" before renaming the new one in. Killed between
// the two renames, it leaves no --out: the next run puts the previous checkpoint back and
// resumes from it; killed after them, the moved-aside one is a leftover, removed.
TEST(Train, CheckpointMovedAsideByAnInterruptedSaveIsRestored) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 3;
  ASSERT_TRUE(train(o).ok());
  const std::string aside = o.out_dir + ".tmp-99999-4.old";
  fs::rename(o.out_dir, aside);
  testing_trainer::write_file(o.out_dir + ".tmp-99999-4/model.safetensors", "half");
  auto fresh = train(o);  // a new run would save over it: refused, pointing at --resume
  ASSERT_FALSE(fresh.ok());
  EXPECT_NE(fresh.status().message().find("moved aside to '" + aside + "'"), std::string::npos)
      << fresh.status();
  EXPECT_NE(fresh.status().message().find("pass --resume"), std::string::npos) << fresh.status();
  EXPECT_TRUE(fs::exists(aside));
  o.resume = true;
  o.steps = 5;
  std::string lines;
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
  auto done = train(o, cb);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_NE(lines.find("resuming at step 3 of 5"), std::string::npos) << lines;
  EXPECT_NE(lines.find("restoring " + o.out_dir + " from " + aside), std::string::npos) << lines;
  EXPECT_FALSE(fs::exists(aside));
  EXPECT_FALSE(fs::exists(o.out_dir + ".tmp-99999-4"));
  fs::copy(o.out_dir, dir + "/copy", fs::copy_options::recursive);
  fs::rename(dir + "/copy", aside);  // killed after both renames: a stale copy
  o.steps = 6;
  ASSERT_TRUE(train(o).ok());
  EXPECT_FALSE(fs::exists(aside));
  EXPECT_EQ(load_run_options(o.out_dir)->steps, 6);
}

TEST(Train, FreshRunRefusesToOverwriteACheckpoint) {
  TrainOptions o = tiny_options(fresh_dir());
  o.steps = 2;
  ASSERT_TRUE(train(o).ok());
  auto again = train(o);
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("--out"), std::string::npos) << again.status();
  EXPECT_NE(again.status().message().find("--resume"), std::string::npos);
}

// A resumed run's --out holding something besides checkpoint files is refused before training,
// not at the first save after it (which would throw the steps away).
TEST(Train, ResumedRunWithForeignFilesInOutIsRefusedBeforeTraining) {
  TrainOptions o = tiny_options(fresh_dir());
  o.steps = 2;
  ASSERT_TRUE(train(o).ok());
  testing_trainer::write_file(o.out_dir + "/notes.txt", "keep me\n");
  o.resume = true;
  o.steps = 4;
  int steps = 0;
  TrainCallbacks cb;
  cb.on_step = [&](const StepMetrics&) { return ++steps, true; };
  auto resumed = train(o, cb);
  ASSERT_FALSE(resumed.ok());
  EXPECT_NE(resumed.status().message().find("'notes.txt'"), std::string::npos) << resumed.status();
  EXPECT_EQ(steps, 0);
  EXPECT_TRUE(fs::exists(o.out_dir + "/notes.txt"));
}

// The run saves its options (paths included) as JSON, which must be UTF-8, but a Linux path need
// not be: such a path made the first save throw (nlohmann's strict dump) after every step had
// run, aborting the process with the lock file and a half-written checkpoint left behind. Now it
// is refused by its flag before anything is done or created.
TEST(Train, PathsThatAreNotUtf8AreRefusedByNameBeforeTraining) {
  const std::string dir = fresh_dir();
  const TrainOptions base = tiny_options(dir);
  testing_trainer::write_file(dir +
                                  "/d\xe4"
                                  "ta/a.txt",
                              testing_trainer::corpus_text(300, 1));
  std::vector<std::pair<std::string, TrainOptions>> cases;
  cases.emplace_back("--out", base);
  cases.back().second.out_dir = dir +
                                "/r\xe4"
                                "n";
  cases.emplace_back("--data", base);
  cases.back().second.data = {dir + "/text", dir +
                                                 "/d\xe4"
                                                 "ta"};
  cases.emplace_back("--cache", base);
  cases.back().second.cache_dir = dir +
                                  "/c\xe4"
                                  "che";
  for (const auto& [flag, o] : cases) {
    const auto before = std::distance(fs::directory_iterator(dir), fs::directory_iterator());
    int steps = 0;
    TrainCallbacks cb;
    cb.on_step = [&](const StepMetrics&) { return ++steps, true; };
    auto run = train(o, cb);
    ASSERT_FALSE(run.ok()) << flag;
    const std::string message(run.status().message());
    EXPECT_NE(message.find(flag + " '"), std::string::npos) << message;
    EXPECT_NE(message.find("not valid UTF-8"), std::string::npos) << message;
    EXPECT_NE(message.find("\\xe4"), std::string::npos) << message;  // escaped, not raw
    EXPECT_EQ(steps, 0) << flag;
    EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), before)
        << flag << ": something was created";
  }
}

// A run killed while it wrote a cache file left its temporary file for good: the next run removes
// those of processes that are gone, untouched for 10 minutes, and keeps a live process's (a run
// sharing the cache, writing now), a recent one's (perhaps another host's) and files of other
// names.
TEST(Train, TemporaryCacheFilesOfKilledRunsAreRemoved) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.cache_dir = dir + "/cache";
  o.steps = 1;
  const pid_t gone = fork();
  if (gone == 0) _exit(0);
  ASSERT_GT(gone, 0);
  ASSERT_EQ(waitpid(gone, nullptr, 0), gone);
  const std::string dead = o.cache_dir + "/tokens.bin.tmp." + std::to_string(gone) + ".3",
                    dead_key = o.cache_dir + "/tokenizer.key.tmp." + std::to_string(gone) + ".0",
                    live = o.cache_dir + "/tokens.bin.tmp." + std::to_string(getpid()) + ".0",
                    recent = o.cache_dir + "/tokens.bin.tmp." + std::to_string(gone) + ".9",
                    other = o.cache_dir + "/notes.tmp." + std::to_string(gone) + ".0";
  for (const std::string& f : {dead, dead_key, live, recent, other}) {
    testing_trainer::write_file(f, "x");
    if (f != recent)
      fs::last_write_time(f, fs::file_time_type::clock::now() - std::chrono::minutes(11));
  }
  std::string lines;
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
  ASSERT_TRUE(train(o, cb).ok());
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_FALSE(fs::exists(dead_key));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(recent));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_NE(lines.find("removed " + dead + ", left by a run that was killed"), std::string::npos)
      << lines;
}

// Runs that share a --cache: another run training its own tokenizer into the cache while this one
// trains must not change the tokenizer this one saves (its data was encoded with the first).
TEST(Train, CheckpointKeepsItsTokenizerWhenTheSharedCacheChanges) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.cache_dir = dir + "/shared-cache";
  o.steps = 4;
  o.save_every = 1;
  std::string original, error;
  TrainCallbacks cb;
  cb.on_step = [&](const StepMetrics& m) {
    if (m.step == 2) {  // saved once already; now the cache's tokenizer is replaced
      EXPECT_TRUE(read_file(o.cache_dir + "/tokenizer.model", &original, &error)) << error;
      testing_trainer::write_file(o.cache_dir + "/tokenizer.model", "another run's tokenizer");
    }
    return true;
  };
  ASSERT_TRUE(train(o, cb).ok());
  std::string saved;
  ASSERT_TRUE(read_file(o.out_dir + "/tokenizer.model", &saved, &error)) << error;
  ASSERT_FALSE(original.empty());
  EXPECT_TRUE(saved == original) << "the checkpoint took the replaced cache file";
  EXPECT_TRUE(load_checkpoint(o.out_dir).ok());
}

// The cache's tokenizer is reused only while its key names this data, this vocabulary and the
// model file's bytes: one replaced behind the key (a run sharing --cache, a save cut between the
// two files), or damaged, is trained again; a tokenizer that does not load is named by where it
// came from (--init, --resume), not as a --tokenizer the run was not given.
TEST(Train, ACachedTokenizerThatIsNotTheKeysIsTrainedAgain) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.cache_dir = dir + "/cache";
  o.steps = 1;
  auto run_saying = [&](const TrainOptions& opts) {
    std::string lines;
    TrainCallbacks cb;
    cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
    const auto r = train(opts, cb);
    EXPECT_TRUE(r.ok()) << r.status();
    return lines;
  };
  std::string said = run_saying(o);
  EXPECT_NE(said.find("tokenizer: training"), std::string::npos) << said;
  std::string trained, error;
  ASSERT_TRUE(read_file(o.cache_dir + "/tokenizer.model", &trained, &error)) << error;
  fs::remove_all(o.out_dir);
  said = run_saying(o);
  EXPECT_NE(said.find("tokenizer: reusing"), std::string::npos) << said;
  // Damaged behind its key: trained again, and said why.
  testing_trainer::write_file(o.cache_dir + "/tokenizer.model", "damaged");
  fs::remove_all(o.out_dir);
  said = run_saying(o);
  const std::string why =
      "tokenizer.key is for other data, another vocabulary or another model "
      "file (a run sharing --cache, an older cemlm, a damaged or replaced "
      "file): training it again";
  EXPECT_NE(said.find(why), std::string::npos) << said;
  EXPECT_NE(said.find("tokenizer: training"), std::string::npos) << said;
  std::string again;
  ASSERT_TRUE(read_file(o.cache_dir + "/tokenizer.model", &again, &error)) << error;
  EXPECT_TRUE(again == trained) << "training is deterministic: the same tokenizer again";
  // Another valid tokenizer put there (another corpus's) does not pass for this one.
  TrainOptions other = tiny_options(dir + "/other");
  other.cache_dir = dir + "/other-cache";
  testing_trainer::write_file(dir + "/other/text/a.txt", testing_trainer::corpus_text(300, 7));
  run_saying(other);
  std::string foreign;
  ASSERT_TRUE(read_file(other.cache_dir + "/tokenizer.model", &foreign, &error)) << error;
  ASSERT_FALSE(foreign == trained);
  fs::copy_file(other.cache_dir + "/tokenizer.model", o.cache_dir + "/tokenizer.model",
                fs::copy_options::overwrite_existing);
  fs::remove_all(o.out_dir);
  said = run_saying(o);
  EXPECT_NE(said.find(why), std::string::npos) << said;
  // A checkpoint's own tokenizer that does not load is named by the flag that brought it.
  testing_trainer::write_file(o.out_dir + "/tokenizer.model", "damaged");
  TrainOptions init = o;
  init.init_dir = o.out_dir;
  init.config_path.clear();
  init.out_dir = dir + "/from-init";
  const auto refused = train(init, {});
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "--init: ")) << refused.status();
}

// --resume needs the tokenizer its data was encoded with; --init keeps its checkpoint's
// vocabulary and tokenizer, so flags that would change them are refused, not ignored.
TEST(Train, ResumeWithoutTokenizerAndInitWithAnotherVocabularyAreRefused) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 2;
  ASSERT_TRUE(train(o).ok());
  const std::string tok = dir + "/tok-copy.model";
  fs::copy_file(o.out_dir + "/tokenizer.model", tok);

  TrainOptions init = tiny_options(dir);
  init.config_path.clear();
  init.init_dir = o.out_dir;
  init.out_dir = dir + "/finetune";
  init.tokenizer_path = tok;
  auto st = train(init);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("--tokenizer"), std::string::npos) << st.status();
  // --init and --out the same: said as such (it advised --init, already given).
  TrainOptions onto = init;
  onto.out_dir = o.out_dir + "/";
  onto.tokenizer_path.clear();
  st = train(onto);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("--init and --out name the same checkpoint '" +
                                       onto.out_dir + "'"),
            std::string::npos)
      << st.status();
  init.tokenizer_path.clear();
  init.vocab_size = 999;
  st = train(init);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("--vocab-size 999"), std::string::npos) << st.status();
  EXPECT_FALSE(fs::exists(init.out_dir + "/config.json"));
  // A --cache in --init's checkpoint is refused before it is written: its tokens.bin made the
  // checkpoint one that no run could save or resume into.
  init.vocab_size = 0;
  auto names = [](const std::string& d) {
    std::set<std::string> n;
    for (const auto& e : fs::directory_iterator(d)) n.insert(e.path().filename().string());
    return n;
  };
  const auto before = names(o.out_dir);
  for (const std::string& cache : {o.out_dir, o.out_dir + "/cache"}) {
    init.cache_dir = cache;
    st = train(init);
    ASSERT_FALSE(st.ok()) << cache;
    EXPECT_NE(st.status().message().find("--init"), std::string::npos) << st.status();
    EXPECT_NE(st.status().message().find("choose a --cache outside it"), std::string::npos)
        << st.status();
    EXPECT_EQ(names(o.out_dir), before) << cache;
  }
  init.cache_dir.clear();
  // So is an --out inside --init (its directory and lock file were left there), with or without
  // --cache; and a default '<out>.cache' that is --init, named as such.
  const std::string out = init.out_dir;
  init.out_dir = o.out_dir + "/run2";
  for (const std::string& cache : {std::string(), dir + "/elsewhere"}) {
    init.cache_dir = cache;
    st = train(init);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.status().message().find("--out '" + o.out_dir + "/run2' is inside --init"),
              std::string::npos)
        << st.status();
    EXPECT_EQ(names(o.out_dir), before);
  }
  init.cache_dir.clear();
  fs::copy(o.out_dir, dir + "/ck.cache", fs::copy_options::recursive);
  init.init_dir = dir + "/ck.cache";
  init.out_dir = dir + "/ck";
  st = train(init);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(
      st.status().message().find("the default --cache '" + dir + "/ck.cache' is --init itself"),
      std::string::npos)
      << st.status();
  EXPECT_NE(st.status().message().find("give a --cache outside it, or another --out"),
            std::string::npos)
      << st.status();
  init.init_dir = o.out_dir;
  init.out_dir = out;

  fs::remove(o.out_dir + "/tokenizer.model");
  o.resume = true;
  o.steps = 4;
  st = train(o);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("tokenizer.model"), std::string::npos) << st.status();
  fs::copy_file(tok, o.out_dir + "/tokenizer.model");
  EXPECT_TRUE(train(o).ok());  // restored: the run goes on
}

// A run saved before the split moved to document starts resumes on the current split, and says
// so; one saved since says nothing.
// A resume says when the validation split is not the run's: its saved validation ids' hash
// differs (here: another --val-fraction... or a damaged hash), or a state saved before the hash was
// names an older split rule.
TEST(Train, ResumingOnAnotherValidationSplitSaysSo) {
  TrainOptions o = tiny_options(fresh_dir());
  o.steps = 2;
  ASSERT_TRUE(train(o).ok());
  o.resume = true;
  auto resume_lines = [&](int64_t steps) {
    o.steps = steps;
    std::string lines;
    TrainCallbacks cb;
    cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
    EXPECT_TRUE(train(o, cb).ok());
    return lines;
  };
  EXPECT_EQ(resume_lines(3).find("validation split"), std::string::npos);
  const std::string state_file = o.out_dir + "/trainer_state.json";
  // The state as `edit` leaves it, then the resume's lines.
  auto resume_edited = [&](int64_t steps, const std::function<void(nlohmann::json&)>& edit) {
    std::string state, error;
    EXPECT_TRUE(read_file(state_file, &state, &error)) << error;
    nlohmann::json j = nlohmann::json::parse(state);
    edit(j);
    testing_trainer::write_file(state_file, j.dump(2) + "\n");
    return resume_lines(steps);
  };
  std::string lines = resume_edited(4, [](nlohmann::json& j) {
    j["validation_hash"] = j["validation_hash"].get<uint64_t>() ^ 1;
  });
  EXPECT_NE(lines.find("the validation split is not the run's (other --data"), std::string::npos)
      << lines;
  // Saved before the hash: the rule tells. None (the first rule), the one before the current.
  lines = resume_edited(5, [](nlohmann::json& j) {
    j.erase("validation_hash");
    j.erase("split");
  });
  EXPECT_NE(lines.find("older cemlm, whose split cut documents in two"), std::string::npos)
      << lines;
  lines = resume_edited(6, [](nlohmann::json& j) {
    j.erase("validation_hash");
    j["split"] = "document-start";
  });
  EXPECT_NE(lines.find("older cemlm, whose split gave the end of a file"), std::string::npos)
      << lines;
  lines = resume_edited(7, [](nlohmann::json& j) {
    j.erase("validation_hash");
    j["split"] = "document-start,end-trains";
  });
  EXPECT_NE(lines.find("older cemlm, whose split cut a piece out of each file that is one "
                       "document"),
            std::string::npos)
      << lines;
  // The current rule without a hash, and a hash that matches: nothing to say.
  lines = resume_edited(8, [](nlohmann::json& j) { j.erase("validation_hash"); });
  EXPECT_EQ(lines.find("validation split"), std::string::npos) << lines;
  lines = resume_edited(9, [](nlohmann::json& j) { j["split"] = "document-start"; });
  EXPECT_EQ(lines.find("validation split"), std::string::npos) << lines;
}

// Another tokenizer put in the run's place is refused: the weights went on training on its ids
// (it was only "the validation split is not the run's"), and the save kept it as the checkpoint's.
// A state saved before the hash resumes as it did. A checkpoint that cannot be resumed is refused
// before the corpus is read (it was encoded first: minutes on a large one).
TEST(Train, ResumeRefusesAnotherTokenizerAndADamagedCheckpointBeforeTheData) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 2;
  ASSERT_TRUE(train(o).ok());
  TrainOptions other = tiny_options(dir);
  other.out_dir = dir + "/other";
  other.vocab_size = 295;
  other.steps = 1;
  ASSERT_TRUE(train(other).ok());
  const std::string tok = o.out_dir + "/tokenizer.model";
  fs::copy_file(tok, dir + "/own.model");
  fs::copy_file(other.out_dir + "/tokenizer.model", tok, fs::copy_options::overwrite_existing);
  o.resume = true;
  o.steps = 3;
  std::string lines;
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
  auto st = train(o, cb);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find("--resume: " + tok +
                                       " is not the tokenizer the run trained with (" +
                                       kTrainerStateFile + " holds another one's hash)"),
            std::string::npos)
      << st.status();
  EXPECT_EQ(lines.find("data: "), std::string::npos) << lines;
  fs::copy_file(dir + "/own.model", tok, fs::copy_options::overwrite_existing);
  // Saved by a cemlm before the hash: resumed as before.
  const std::string state_file = o.out_dir + "/" + kTrainerStateFile;
  std::string state, error;
  ASSERT_TRUE(read_file(state_file, &state, &error)) << error;
  nlohmann::json j = nlohmann::json::parse(state);
  ASSERT_TRUE(j.contains("tokenizer_hash"));
  j.erase("tokenizer_hash");
  testing_trainer::write_file(state_file, j.dump(2) + "\n");
  ASSERT_TRUE(train(o).ok());
  // An optimizer state gone: refused before the data.
  fs::remove(o.out_dir + "/" + kOptimizerFile);
  o.steps = 4;
  lines.clear();
  st = train(o, cb);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.status().message().find(kOptimizerFile), std::string::npos) << st.status();
  EXPECT_EQ(lines.find("data: "), std::string::npos) << lines;
}

// A config whose bos_id is a piece of the text (id 5, the byte piece <0x01>) is said to be one: the
// documents' starts were marked with a byte their text holds too, without a word. The tokenizer's
// own ids, or an id no text encodes to, say nothing.
TEST(Train, AConfigBosThatIsATextPieceIsNoted) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 1;
  auto lines_with = [&](const std::string& ids, const std::string& out) {
    testing_trainer::write_file(o.config_path, testing_trainer::tiny_config_json(ids));
    o.out_dir = dir + "/" + out;
    std::string lines;
    TrainCallbacks cb;
    cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
    EXPECT_TRUE(train(o, cb).ok());
    return lines;
  };
  const std::string lines = lines_with(R"(, "bos_id": 5)", "byte");
  EXPECT_NE(lines.find("note: the config's bos_id 5 is the tokenizer's piece '<0x01>', which "
                       "text encodes to as well (the tokenizer's own is 1)"),
            std::string::npos)
      << lines;
  EXPECT_EQ(lines.find("eos_id"), std::string::npos) << lines;
  EXPECT_EQ(lines_with(R"(, "bos_id": 1, "eos_id": 2)", "own").find("note: the config's"),
            std::string::npos);
  // The unknown id: with byte pieces, no text encodes to it.
  EXPECT_EQ(lines_with(R"(, "bos_id": 0)", "unk").find("note: the config's"), std::string::npos);
  // Past the tokenizer's pieces (a model's vocabulary larger than them): no text encodes to it
  // (it decodes like the unknown id, " ⁇ ", and was taken for a text piece).
  o.vocab_size = 290;
  lines_with("", "tok290");  // a tokenizer of 290 pieces
  o.vocab_size = 0;
  o.tokenizer_path = dir + "/tok290/tokenizer.model";  // for the config's 300 ids
  EXPECT_EQ(lines_with(R"(, "bos_id": 299)", "past").find("note: the config's"), std::string::npos);
}

TEST(Train, DamagedSavedOptionsNameTheKey) {
  const std::string json = options_to_json(TrainOptions{});
  const size_t at = json.find("\"steps\"");
  ASSERT_NE(at, std::string::npos);
  const size_t value = json.find(':', at) + 1, end = json.find_first_of(",}", value);
  const std::string bad = json.substr(0, value) + " \"many\"" + json.substr(end);
  auto o = options_from_json(bad);
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("\"steps\""), std::string::npos) << o.status();
  std::string missing = json;
  missing.replace(missing.find("\"seed\""), 6, "\"sead\"");
  o = options_from_json(missing);
  ASSERT_FALSE(o.ok());
  EXPECT_NE(o.status().message().find("\"seed\""), std::string::npos) << o.status();
  EXPECT_TRUE(options_from_json(json).ok());
}

// A stop asked for while the data loads ends the run before its first step, writing nothing.
TEST(Train, StopBeforeTrainingSavesNothing) {
  TrainOptions o = tiny_options(fresh_dir());
  TrainCallbacks cb;
  cb.stop_before_training = [](bool) { return true; };
  auto done = train(o, cb);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->step, 0);
  EXPECT_FALSE(done->finished);
  EXPECT_FALSE(fs::exists(o.out_dir + "/config.json"));
}

// A stop asked for while the tokenizer trains or the data is encoded is honoured once that part
// is done (after the tokenizer, before each file), not only before the first step.
TEST(Train, StopDuringSetupEndsTheRunAfterThePartInProgress) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 1;
  std::vector<bool> checks;  // `last` of each check, in order
  auto run_stopping_at = [&](size_t check) {
    checks.clear();
    std::string lines;
    TrainCallbacks cb;
    cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
    cb.stop_before_training = [&](bool last) {
      checks.push_back(last);
      return checks.size() == check;
    };
    auto done = train(o, cb);
    EXPECT_TRUE(done.ok()) << done.status();
    if (done.ok()) {
      EXPECT_EQ(done->step, check > 0 ? 0 : 1);
    }
    return lines;
  };
  const std::string after_tokenizer = run_stopping_at(1);
  EXPECT_EQ(checks, std::vector<bool>{false});
  EXPECT_NE(after_tokenizer.find("nothing trained, nothing saved"), std::string::npos);
  EXPECT_TRUE(fs::exists(dir + "/run.cache/tokenizer.model"));
  EXPECT_FALSE(fs::exists(dir + "/run.cache/tokens.bin"));
  EXPECT_FALSE(fs::exists(o.out_dir + "/config.json"));
  run_stopping_at(3);  // before the second of the two files
  EXPECT_EQ(checks, (std::vector<bool>{false, false, false}));
  EXPECT_FALSE(fs::exists(dir + "/run.cache/tokens.bin"));
  EXPECT_FALSE(fs::exists(o.out_dir + "/config.json"));
  run_stopping_at(0);  // never: after the tokenizer, before each file, before the first step
  EXPECT_EQ(checks, (std::vector<bool>{false, false, false, true}));
  EXPECT_TRUE(fs::exists(o.out_dir + "/config.json"));
}

// A second run on the same --out is refused while the first runs, before it removes what looks
// like a stale save (the first's save in progress), and may go on once the first has ended.
TEST(Train, SecondRunOnTheSameOutIsRefusedWhileTheFirstHoldsIt) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 3;
  const std::string saving = o.out_dir + ".tmp-" + std::to_string(::getpid()) + "-99";
  absl::Status second;
  TrainCallbacks cb;
  cb.on_step = [&](const StepMetrics& m) {
    if (m.step == 1) {
      testing_trainer::write_file(saving + "/model.safetensors", "being written");
      second = train(o).status();
    }
    return true;
  };
  ASSERT_TRUE(train(o, cb).ok());
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.message().find("--out '" + o.out_dir + "' is in use"), std::string::npos)
      << second;
  EXPECT_NE(second.message().find("(pid " + std::to_string(::getpid()) + ")"), std::string::npos)
      << second;
  EXPECT_TRUE(fs::exists(saving + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/.run.lock"));  // beside --out, not in the checkpoint
  o.resume = true;
  o.steps = 4;
  EXPECT_TRUE(train(o).ok());  // the first run let go
}

// The tokenizer a run trains uses the run's --threads (it used every CPU whatever was given, and
// the model file, which records the number, differed from machine to machine): the same as
// `cemlm tokenizer train --threads 1` on the same text.
TEST(Train, TheTokenizerTrainsOnTheRunsThreads) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);  // --threads 1
  o.steps = 1;
  ASSERT_TRUE(train(o).ok());
  TokenizerTrainOptions t{o.data, 300, dir + "/alone.model"};
  t.threads = 1;
  std::string error, alone, saved;
  ASSERT_TRUE(train_tokenizer(t, &error)) << error;
  ASSERT_TRUE(read_file(t.out_path, &alone, &error)) << error;
  ASSERT_TRUE(read_file(o.out_dir + "/tokenizer.model", &saved, &error)) << error;
  EXPECT_EQ(saved, alone);
  t.threads = 2;  // not what it used
  t.out_path = dir + "/two.model";
  ASSERT_TRUE(train_tokenizer(t, &error)) << error;
  ASSERT_TRUE(read_file(t.out_path, &alone, &error)) << error;
  EXPECT_NE(saved, alone);
}

// A --cache that is a file is refused before the tokenizer trains (it was refused writing there,
// after training: 30 s on the default corpus).
TEST(Train, ACacheThatIsAFileIsRefusedBeforeTheTokenizerTrains) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.cache_dir = dir + "/cache";
  testing_trainer::write_file(o.cache_dir, "a file");
  std::vector<std::string> notes;
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { notes.push_back(s); };
  const auto st = train(o, cb).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("--cache '" + o.cache_dir + "' is not a directory"),
            std::string::npos)
      << st;
  for (const std::string& n : notes) EXPECT_EQ(n.find("tokenizer: training"), std::string::npos);
}

// --out that is a link is followed once, at the start: re-pointed during the run, it sent the
// later saves into whatever it named then (here another run's checkpoint, whose lock this run
// never took).
TEST(Train, SavesGoWhereALinkOutNamedAtTheStart) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  TrainOptions other = o;
  other.out_dir = dir + "/other";
  other.steps = 2;
  ASSERT_TRUE(train(other).ok());
  std::string other_state, other_weights, error;
  ASSERT_TRUE(read_file(other.out_dir + "/" + kTrainerStateFile, &other_state, &error));
  ASSERT_TRUE(read_file(other.out_dir + "/model.safetensors", &other_weights, &error));
  const std::string link = dir + "/latest";
  fs::create_directory_symlink("run", link);  // dir/run, made by the first save
  o.out_dir = link;
  o.steps = 6;
  o.save_every = 2;
  TrainCallbacks cb;
  cb.on_save = [&](int64_t step, const std::string&) {
    if (step != 2) return;
    fs::remove(link);
    fs::create_directory_symlink("other", link);
  };
  ASSERT_TRUE(train(o, cb).ok());
  std::string text;
  ASSERT_TRUE(read_file(other.out_dir + "/" + kTrainerStateFile, &text, &error));
  EXPECT_EQ(text, other_state) << "the other run's checkpoint was replaced";
  ASSERT_TRUE(read_file(other.out_dir + "/model.safetensors", &text, &error));
  EXPECT_EQ(text, other_weights);
  ASSERT_TRUE(read_file(dir + "/run/" + kTrainerStateFile, &text, &error));
  EXPECT_NE(text.find("\"step\": 6,"), std::string::npos) << text;
}

// A step whose loss is not finite (logits that overflow), or whose gradient is not finite though
// its loss is (weights that overflow only the backward), stops the run before the update: no NaN
// weights are evaluated or saved.
TEST(Train, NonFiniteLossOrGradientStopsTheRunBeforeTheUpdate) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 1;
  ASSERT_TRUE(train(o).ok());
  auto ck = load_checkpoint(o.out_dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  ParamStore infinite_logits = ck->params;  // logits ~1e48
  testing_models::scale_param(infinite_logits, "final_norm.weight", 1e20f);
  testing_models::scale_param(infinite_logits, "lm_head.weight", 1e30f);
  ASSERT_TRUE(
      save_checkpoint(dir + "/infinite", ck->config, infinite_logits, ck->tokenizer_path).ok());
  // Logits ~1e22: loss and gradient finite, but the gradient's squares past a float.
  ParamStore huge_logits = ck->params;
  testing_models::scale_param(huge_logits, "lm_head.weight", 1e22f);
  ASSERT_TRUE(save_checkpoint(dir + "/huge", ck->config, huge_logits, ck->tokenizer_path).ok());
  testing_models::overflow_the_backward(ck->config, ck->params);  // the loss stays finite
  ASSERT_TRUE(save_checkpoint(dir + "/overflow", ck->config, ck->params, ck->tokenizer_path).ok());

  struct Case {
    std::string from;
    double clip;
    std::string says;
  };
  for (const auto& [from, clip, says] :
       std::vector<Case>{{"infinite", 1.0, "the loss at step 1 is not finite"},
                         {"overflow", 1.0, "the gradient norm at step 1 is not finite"},
                         // Unclipped, its moments were inf: those weights froze without a word and
                         // the saved optimizer state failed --resume.
                         {"huge", 0.0, "the gradient norm at step 1 is "}}) {
    TrainOptions init = tiny_options(dir);
    init.config_path.clear();
    init.init_dir = dir + "/" + from;
    init.out_dir = dir + "/finetune-" + from;
    init.clip = clip;
    init.eval_every = 1;
    init.save_every = 1;
    int steps = 0, evals = 0;
    TrainCallbacks cb;
    cb.on_step = [&](const StepMetrics&) { return ++steps, true; };
    cb.on_eval = [&](const EvalMetrics&) { ++evals; };
    auto st = train(init, cb);
    ASSERT_FALSE(st.ok()) << from;
    const std::string error(st.status().message());
    EXPECT_NE(error.find("training diverged: " + says), std::string::npos) << error;
    // Step 1 of a new run: no checkpoint to keep (it said "the last checkpoint is kept").
    EXPECT_NE(error.find("(the run saved no checkpoint)"), std::string::npos) << error;
    EXPECT_FALSE(fs::exists(init.out_dir + "/config.json"));
    if (clip == 0) {
      EXPECT_NE(error.find("whose squares AdamW's float moments hold (the loss is "),
                std::string::npos)
          << error;
    }
    EXPECT_EQ(steps, 0) << from;
    EXPECT_EQ(evals, 0) << from;
    EXPECT_FALSE(fs::exists(init.out_dir + "/config.json")) << from;
  }
  // Clipped, the same gradient is a step, and the run saves a state it resumes from.
  TrainOptions clipped = tiny_options(dir);
  clipped.config_path.clear();
  clipped.init_dir = dir + "/huge";
  clipped.out_dir = dir + "/finetune-clipped";
  ASSERT_TRUE(train(clipped).ok());
  clipped.init_dir.clear();
  clipped.resume = true;
  clipped.steps += 1;
  EXPECT_TRUE(train(clipped).ok());
}

// An update that leaves the weights finite but their validation loss not (here from first moments
// of 1e22 put in a sound optimizer file, as a damaged state or a wild step could make one) stops
// the run: it wrote the ruined weights over the good checkpoint and exited 0.
TEST(Train, WeightsWithANonFiniteValidationLossAreNotSaved) {
  const std::string dir = fresh_dir();
  TrainOptions o = tiny_options(dir);
  o.steps = 1;
  ASSERT_TRUE(train(o).ok());
  const std::vector<float> good = weights_of(o.out_dir);
  const std::string path = o.out_dir + "/optimizer.safetensors";
  std::vector<NamedTensor> damaged;
  std::vector<std::vector<float>> values;
  std::map<std::string, std::string> metadata;
  {
    auto file = SafetensorsFile::open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    for (const TensorInfo& t : file->tensors()) {
      auto v = file->read_f32(t.name);
      ASSERT_TRUE(v.ok()) << v.status();
      // Updates of ~1e20 to one weight of the final norm and one of the head that meets it: the
      // logit of the head's row is past a float.
      if (t.name == "adam_m.final_norm.weight" || t.name == "adam_m.lm_head.weight")
        (*v)[3] = 1e22f;
      if (t.name == "adam_v.final_norm.weight" || t.name == "adam_v.lm_head.weight") (*v)[3] = 1;
      values.push_back(*std::move(v));
    }
    for (size_t i = 0; i < values.size(); ++i)
      damaged.push_back({file->tensors()[i].name, file->tensors()[i].shape, values[i]});
    metadata = file->metadata();
  }
  // Step 2 evaluated (the run's last), and step 2 saved between evaluations (every 4 steps):
  // there one batch of validation windows is checked before the save.
  for (const auto& [steps, eval_every] : {std::pair{2, 6}, std::pair{5, 4}}) {
    SCOPED_TRACE(eval_every);
    ASSERT_TRUE(write_safetensors(path, damaged, metadata).ok());
    TrainOptions resumed = o;
    resumed.resume = true;
    resumed.steps = steps;
    resumed.eval_every = eval_every;
    resumed.save_every = 1;
    auto st = train(resumed);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.status().message().find(
                  "training diverged: the validation loss at step 2 is not finite at T = "),
              std::string::npos)
        << st.status();
    EXPECT_NE(st.status().message().find("nothing saved (the last checkpoint is kept)"),
              std::string::npos)
        << st.status();
    EXPECT_EQ(weights_of(o.out_dir), good);
  }
}

// Options of an --init run on `data` into dir/finetune, from a one-step checkpoint of the tiny
// model (300 ids) without its tokenizer, as `cemlm init` writes one.
TrainOptions init_without_tokenizer(const std::string& dir, std::vector<std::string> data) {
  TrainOptions o = tiny_options(dir);
  o.steps = 1;
  EXPECT_TRUE(train(o).ok());
  fs::remove(o.out_dir + "/tokenizer.model");
  TrainOptions init = tiny_options(dir);
  init.config_path.clear();
  init.init_dir = o.out_dir;
  init.out_dir = dir + "/finetune";
  init.data = std::move(data);
  return init;
}

// --init keeps its checkpoint's vocabulary: errors about a tokenizer that does not fit it say
// what can be done instead of "raise --vocab-size", which --init refuses.
TEST(Train, InitErrorsAboutTheVocabularyDoNotAdviseVocabSize) {
  const std::string dir = fresh_dir();
  TrainOptions init = init_without_tokenizer(dir, {dir + "/text", dir + "/han"});
  std::string han;  // 120 characters the tiny model's 300 ids cannot hold with the bytes
  for (int i = 0; i < 40; ++i)
    for (char32_t c = 0x4E00; c < 0x4E00 + 120; ++c)
      han += std::string{char(0xE0 | (c >> 12)), char(0x80 | ((c >> 6) & 0x3F)),
                         char(0x80 | (c & 0x3F))} +
             (c % 10 ? "" : "\n");
  testing_trainer::write_file(dir + "/han/a.txt", han);
  auto st = train(init);
  ASSERT_FALSE(st.ok());
  const std::string trained(st.status().message());
  EXPECT_EQ(trained.find("raise --vocab-size"), std::string::npos) << trained;
  EXPECT_EQ(trained.find("use at least"), std::string::npos) << trained;
  EXPECT_NE(trained.find("the model of --init has vocab_size 300"), std::string::npos) << trained;
  EXPECT_NE(trained.find("--tokenizer FILE with at most 300 pieces"), std::string::npos) << trained;

  std::string error;
  TokenizerTrainOptions big{init.data, 500, dir + "/big.model"};
  ASSERT_TRUE(train_tokenizer(big, &error)) << error;
  init.tokenizer_path = big.out_path;
  st = train(init);
  ASSERT_FALSE(st.ok());
  const std::string given(st.status().message());
  EXPECT_EQ(given.find("raise --vocab-size"), std::string::npos) << given;
  EXPECT_NE(given.find("has 500 pieces"), std::string::npos) << given;
  EXPECT_NE(given.find("use a tokenizer with at most 300 pieces"), std::string::npos) << given;
  EXPECT_FALSE(fs::exists(init.out_dir + "/config.json"));
}

// A warmup as long as the run reaches --lr at its last step (step s runs at --lr (s + 1) /
// --warmup); a longer one never does. The note said "never" for both.
TEST(Train, AWarmupAsLongAsTheRunIsNotedAsSuch) {
  const std::string dir = fresh_dir();
  for (int warmup : {2, 3}) {
    TrainOptions o = tiny_options(dir);
    o.out_dir = dir + "/w" + std::to_string(warmup);
    o.steps = 2;
    o.warmup = warmup;
    std::string lines;
    std::vector<double> lrs;
    TrainCallbacks cb;
    cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
    cb.on_step = [&](const StepMetrics& m) {
      lrs.push_back(m.lr);
      return true;
    };
    ASSERT_TRUE(train(o, cb).ok());
    ASSERT_EQ(lrs.size(), 2u);
    if (warmup == 2) {
      EXPECT_EQ(lrs.back(), o.lr);
      EXPECT_NE(lines.find("the learning rate reaches --lr only at the last step and never "
                           "decays"),
                std::string::npos)
          << lines;
    } else {
      EXPECT_LT(lrs.back(), o.lr);
      EXPECT_NE(lines.find("the learning rate never reaches --lr"), std::string::npos) << lines;
    }
  }
}

// --init on a text too small for the model's vocabulary trains a tokenizer with the most pieces
// the text makes (a tokenizer may use fewer ids than the model has): it failed, advising a
// --vocab-size that --init refuses. A new model's error names where its vocab_size came from.
TEST(Train, InitOnASmallTextTrainsATokenizerWithFewerPieces) {
  const std::string dir = fresh_dir();
  TrainOptions init = init_without_tokenizer(dir, {dir + "/small"});
  std::string small;  // a few letters: fewer than 300 pieces in all, the byte pieces included
  for (int i = 0; i < 60; ++i) small += i % 2 ? "abba baab ab\n" : "baba abab ba\n";
  testing_trainer::write_file(dir + "/small/a.txt", small);
  init.steps = 1;
  init.seq_len = 8;
  init.val_fraction = 0.2;
  std::string lines;
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { lines += s + "\n"; };
  auto done = train(init, cb);
  ASSERT_TRUE(done.ok()) << done.status() << "\n" << lines;
  EXPECT_NE(lines.find("fewer than the --init model's vocab_size 300: training "),
            std::string::npos)
      << lines;
  auto ck = load_checkpoint(init.out_dir);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->config.vocab_size, 300);
  std::string error;
  auto tok = Tokenizer::load(ck->tokenizer_path, &error);
  ASSERT_TRUE(tok) << error;
  EXPECT_LT(tok->vocab_size(), 300);
  // Another --init run of that vocabulary on the same data and cache reuses that tokenizer.
  TrainOptions again = init;
  again.out_dir = dir + "/again";
  again.cache_dir = init.cache_dir.empty() ? init.out_dir + ".cache" : init.cache_dir;
  lines.clear();
  done = train(again, cb);
  ASSERT_TRUE(done.ok()) << done.status() << "\n" << lines;
  EXPECT_NE(lines.find("tokenizer: reusing"), std::string::npos) << lines;

  TrainOptions fresh = tiny_options(dir);  // its --config's vocab_size: 300
  fresh.out_dir = dir + "/fresh";
  fresh.data = init.data;
  fresh.seq_len = 8;
  fresh.val_fraction = 0.2;
  // Alike with the --init run's cache, whose tokenizer has fewer pieces than 300: it was reused.
  for (const std::string& cache : {std::string(), init.out_dir + ".cache"}) {
    fresh.cache_dir = cache;
    auto refused = train(fresh);
    ASSERT_FALSE(refused.ok()) << cache;
    EXPECT_NE(refused.status().message().find("--config's vocab_size 300 is more pieces than "
                                              "this text makes"),
              std::string::npos)
        << refused.status();
  }
}

// --max-minutes stops when the step's own due evaluation and save, the next step, and the final
// evaluation and save would not fit the budget.
TEST(TimeBudget, LeavesRoomForTheNextStepAndTheFinalEvaluationAndSave) {
  TimeBudget b{.step_s = 1, .eval_s = 10, .save_s = 2};
  EXPECT_FALSE(b.stop_now(40, 60, false, false));  // 40 + 1 + 12 = 53
  EXPECT_TRUE(b.stop_now(48, 60, false, false));   // 48 + 1 + 12 = 61
  EXPECT_TRUE(b.stop_now(40, 60, true, false));    // this step's evaluation is due: 63
  EXPECT_TRUE(b.stop_now(46, 60, false, true));    // ... or its save: 61
  EXPECT_FALSE(TimeBudget{.step_s = 1}.stop_now(58, 60, true, true));
}

// --max-minutes is the run's wall-clock budget, set-up included (training the tokenizer and
// encoding a large corpus can take minutes): a set-up that spent it leaves one step, then the
// stop. It was counted from the first step, so a job sized to its time limit overran it.
TEST(Train, MaxMinutesCountsTheSetUp) {
  TrainOptions o = tiny_options(fresh_dir());
  o.max_minutes = 0.005;  // 0.3 s
  TrainCallbacks cb;
  cb.stop_before_training = [](bool last) {
    if (last) std::this_thread::sleep_for(std::chrono::milliseconds(400));  // a slow set-up
    return false;
  };
  auto done = train(o, cb);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->step, 1);
  EXPECT_FALSE(done->finished);
  EXPECT_TRUE(load_checkpoint(o.out_dir).ok());  // resumable
}

// cmd_train with argv; returns its exit code and what it wrote to stderr.
std::pair<int, std::string> cli(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  ::testing::internal::CaptureStderr();
  const int rc = cli::cmd_train(int(argv.size()), argv.data());
  return {rc, ::testing::internal::GetCapturedStderr()};
}

TEST(TrainCli, ResumeKeepsTheSavedOptionsAndAppliesOnlyTheFlagsGiven) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  const std::vector<std::string> base = {
      "--config",         o.config_path, "--data",    o.data[0], "--out",          o.out_dir,
      "--batch-size",     "4",           "--seq-len", "24",      "--eval-windows", "4",
      "--eval-recursion", "1",           "--threads", "1",       "--lr",           "0.005"};
  auto args = base;
  for (std::string a : {"--steps", "3"}) args.push_back(a);
  ASSERT_EQ(cli(args).first, 0);
  ASSERT_EQ(cli({"--out", o.out_dir, "--resume", "--steps", "5"}).first, 0);
  auto saved = load_run_options(o.out_dir);
  ASSERT_TRUE(saved.ok());
  EXPECT_EQ(saved->steps, 5);
  EXPECT_EQ(saved->lr, 0.005);
  // --min-lr left out: a tenth of --lr (a fixed 3e-4 before, which refused `--lr 1e-4` alone),
  // as written in decimal: 0.003 / 10 was 0.00030000000000000003, quoted so in messages.
  EXPECT_DOUBLE_EQ(saved->min_lr, 0.0005);
  const auto [lr_rc, lr_err] =
      cli({"--config", o.config_path, "--data", o.data[0], "--out", dir + "/lr3", "--lr", "0.003",
           "--batch-size", "4", "--seq-len", "24", "--threads", "1", "--steps", "1"});
  ASSERT_EQ(lr_rc, 0) << lr_err;
  auto lr3 = load_run_options(dir + "/lr3");
  ASSERT_TRUE(lr3.ok()) << lr3.status();
  EXPECT_EQ(lr3->min_lr, 0.0003);
  // A tenth of a tiny --lr is below a double's normal range: refused by name (the rounding's
  // std::stod threw, and the process aborted).
  const auto [tiny_rc, tiny_err] = cli({"--config", o.config_path, "--data", o.data[0], "--out",
                                        dir + "/tiny", "--lr", "1e-308", "--steps", "1"});
  EXPECT_NE(tiny_rc, 0);
  EXPECT_NE(tiny_err.find("--lr 1e-308 is too small"), std::string::npos) << tiny_err;
  EXPECT_EQ(saved->seq_len, 24);
  auto log = MetricsLog::parse(
      [&] {
        std::string s, e;
        read_file(o.out_dir + "/" + kMetricsFile, &s, &e);
        return s;
      }(),
      "train.jsonl");
  ASSERT_TRUE(log.ok());
  EXPECT_EQ(log->steps().back().step, 5);
  // The model, tokenizer and seed are the run's own: a flag that would change them is refused
  // (it was ignored, and recorded in the saved options as if it had applied); given again
  // unchanged, as in the first command plus --resume, it is fine.
  testing_trainer::write_file(dir + "/other.json", "{}");
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--config", dir + "/other.json"},
        {"--seed=9"},
        {"--vocab-size", "320"}}) {  // the model's is 300
    std::vector<std::string> resume = {"--out", o.out_dir, "--resume", "--steps", "6"};
    resume.insert(resume.end(), extra.begin(), extra.end());
    const auto [rc, err] = cli(resume);
    EXPECT_EQ(rc, 2) << extra[0];
    EXPECT_NE(err.find(extra[0].substr(0, extra[0].find('=')) + " differs from the run"),
              std::string::npos)
        << err;
  }
  EXPECT_EQ(load_run_options(o.out_dir)->steps, 5);  // nothing ran
  args = base;
  for (std::string a : {"--steps", "6", "--resume"}) args.push_back(a);
  ASSERT_EQ(cli(args).first, 0);
  EXPECT_EQ(load_run_options(o.out_dir)->steps, 6);
  // The run saved no --vocab-size (its config's): the model's own number given is no change.
  ASSERT_EQ(saved->vocab_size, 0);
  const std::string model_vocab = std::to_string(load_checkpoint_config(o.out_dir)->vocab_size);
  const auto [rc, err] =
      cli({"--out", o.out_dir, "--resume", "--steps", "7", "--vocab-size", model_vocab});
  EXPECT_EQ(rc, 0) << err;
  EXPECT_EQ(load_run_options(o.out_dir)->steps, 7);
  // Fewer steps than the run did: refused before anything is set up (it set up the run, then
  // ended with exit 0 saying the steps were done); as many: done, exit 0.
  const auto [rc_fewer, err_fewer] = cli({"--out", o.out_dir, "--resume", "--steps", "3"});
  EXPECT_EQ(rc_fewer, 2);
  EXPECT_NE(
      err_fewer.find("--steps 3 is below the 7 steps the run in '" + o.out_dir + "' already did"),
      std::string::npos)
      << err_fewer;
  EXPECT_EQ(load_run_options(o.out_dir)->steps, 7);
  EXPECT_EQ(cli({"--out", o.out_dir, "--resume", "--steps", "7"}).first, 0);
}

// The command line too puts back a checkpoint an interrupted save moved aside: it read the run's
// options from --out before the run could, and --resume failed with "trainer_state.json does not
// exist", while the error of a new run told the user to pass --resume.
TEST(TrainCli, ResumePutsBackACheckpointMovedAsideByAnInterruptedSave) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  std::vector<std::string> args = {
      "--config", o.config_path, "--data", o.data[0],   "--out", o.out_dir, "--batch-size",
      "4",        "--seq-len",   "24",     "--threads", "1",     "--steps", "3"};
  ASSERT_EQ(cli(args).first, 0);
  const std::string aside = o.out_dir + ".tmp-99999-4.old";
  fs::rename(o.out_dir, aside);
  auto [rc, err] = cli(args);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("pass --resume to put it back"), std::string::npos) << err;
  std::tie(rc, err) = cli({"--out", o.out_dir, "--resume", "--steps", "5"});
  ASSERT_EQ(rc, 0) << err;
  EXPECT_FALSE(fs::exists(aside));
  auto saved = load_run_options(o.out_dir);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->steps, 5);
  EXPECT_EQ(saved->seq_len, 24);  // the run's own options, read from the checkpoint aside
  std::string text, error;
  ASSERT_TRUE(read_file(o.out_dir + "/" + kMetricsFile, &text, &error)) << error;
  auto log = MetricsLog::parse(text, "train.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ(log->steps().front().step, 1);  // continued: the first run's steps are there
  EXPECT_EQ(log->steps().back().step, 5);
}

// One step of the tiny model into o.out_dir by the command line: its trainer_state.json's path
// ("" when the run failed).
std::string one_step_run(const TrainOptions& o) {
  const auto [rc, err] =
      cli({"--config", o.config_path, "--data", o.data[0], "--out", o.out_dir, "--batch-size", "4",
           "--seq-len", "24", "--threads", "1", "--steps", "1"});
  EXPECT_EQ(rc, 0) << err;
  return rc == 0 ? o.out_dir + "/" + kTrainerStateFile : "";
}

// A token count near 2^63 (a damaged state) stops there instead of overflowing: the negative
// count saved made the next resume fail.
TEST(TrainCli, TheTokenCountSaturates) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  const std::string state = one_step_run(o);
  ASSERT_FALSE(state.empty());
  auto tokens_saved = [&] {
    std::string text, error;
    EXPECT_TRUE(read_file(state, &text, &error)) << error;
    return nlohmann::json::parse(text)["tokens"];
  };
  std::string text, error;
  ASSERT_TRUE(read_file(state, &text, &error)) << error;
  nlohmann::json j = nlohmann::json::parse(text);
  j["tokens"] = INT64_MAX - 5;
  testing_trainer::write_file(state, j.dump(2));
  for (const char* steps : {"2", "3"}) {
    const auto [rc, err] = cli({"--out", o.out_dir, "--resume", "--steps", steps});
    ASSERT_EQ(rc, 0) << err;
    EXPECT_EQ(tokens_saved(), INT64_MAX) << steps;
  }
}

// Data inside --cache (or --out) is all the run's own output, left out: the error says so
// instead of only "no UTF-8 text file".
TEST(TrainCli, DataInsideTheCacheIsNamedAsSuch) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  const std::string corpus = o.data[0];  // a directory of texts, made the cache too
  const auto [rc, err] =
      cli({"--config", o.config_path, "--data", o.data[0], "--out", o.out_dir, "--cache", corpus,
           "--seq-len", "24", "--threads", "1", "--steps", "1"});
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("'" + o.data[0] + "' lies inside --cache '" + corpus + "'"), std::string::npos)
      << err;
}

// A --cache that is another checkpoint, or a folder inside one, is refused before anything is
// written: the run replaced that checkpoint's tokenizer.model (its weights then read other ids)
// and left its cache files there, so the checkpoint could not be resumed.
TEST(TrainCli, ACacheInAnotherCheckpointIsRefused) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  ASSERT_FALSE(one_step_run(o).empty());
  const std::string tokenizer = o.out_dir + "/" + kTokenizerFile;
  std::string before, after, error;
  ASSERT_TRUE(read_file(tokenizer, &before, &error)) << error;
  for (const std::string& cache : {o.out_dir, o.out_dir + "/sub"}) {
    const auto [rc, err] =
        cli({"--config", o.config_path, "--data", o.data[0], "--out", dir + "/second", "--cache",
             cache, "--vocab-size", "300", "--seq-len", "24", "--threads", "1", "--steps", "1"});
    EXPECT_EQ(rc, 1) << cache;
    EXPECT_NE(err.find("--cache '" + cache + "' is "), std::string::npos) << err;
    EXPECT_NE(err.find("a checkpoint directory, which holds its own files alone"),
              std::string::npos)
        << err;
  }
  ASSERT_TRUE(read_file(tokenizer, &after, &error)) << error;
  EXPECT_EQ(after, before);
  EXPECT_FALSE(fs::exists(o.out_dir + "/" + kTokenCacheFile));
  EXPECT_FALSE(fs::exists(o.out_dir + "/sub"));
  // Another program's model folder (a config.json that is no cemlm config beside weights) is no
  // checkpoint of ours: a cache inside it is fine.
  testing_trainer::write_file(dir + "/hf/config.json", "{\"model_type\": \"llama\"}\n");
  testing_trainer::write_file(dir + "/hf/model.safetensors", "weights");
  const auto [rc, err] = cli({"--config", o.config_path, "--data", o.data[0], "--out",
                              dir + "/third", "--cache", dir + "/hf/cache", "--batch-size", "4",
                              "--seq-len", "24", "--threads", "1", "--steps", "1"});
  EXPECT_EQ(rc, 0) << err;
}

// A --tokenizer that is missing or no SentencePiece model is refused before --out's folders and
// lock file are made (they were left behind, an empty tree beside a failed run).
TEST(TrainCli, ATokenizerThatDoesNotLoadLeavesNothingBehind) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  testing_trainer::write_file(dir + "/not-a-model", "plain text, not a SentencePiece model\n");
  for (const std::string& tok : {dir + "/missing.model", dir + "/not-a-model"}) {
    const auto [rc, err] =
        cli({"--config", o.config_path, "--data", o.data[0], "--out", dir + "/nest/run",
             "--tokenizer", tok, "--seq-len", "24", "--threads", "1", "--steps", "1"});
    EXPECT_EQ(rc, 1) << tok;
    EXPECT_NE(err.find("--tokenizer: "), std::string::npos) << err;
    EXPECT_NE(err.find(tok), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(dir + "/nest")) << tok;
  }
}

// --resume with --vocab-size and --cache given as the run has them in effect (the model's own
// vocabulary where the run saved 0, the default '<out>.cache' named) is no change: no note that
// the options differ, and the state keeps them as saved.
TEST(TrainCli, ResumeWithTheRunsOwnVocabularyAndCacheChangesNothing) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  const std::string state = one_step_run(o);
  ASSERT_FALSE(state.empty());
  const auto model = load_checkpoint_config(o.out_dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const auto [rc, err] = cli({"--out", o.out_dir, "--resume", "--steps", "2", "--vocab-size",
                              std::to_string(model->vocab_size), "--cache", o.out_dir + ".cache/"});
  ASSERT_EQ(rc, 0) << err;
  EXPECT_EQ(err.find("differ"), std::string::npos) << err;
  std::string text, error;
  ASSERT_TRUE(read_file(state, &text, &error)) << error;
  const nlohmann::json saved = nlohmann::json::parse(text)["options"];
  EXPECT_EQ(saved["vocab_size"], 0) << saved;
  EXPECT_EQ(saved["cache"], "") << saved;
}

// A run started with --tokenizer FILE resumes from its checkpoint's own tokenizer.model: the file
// may be gone since (moved, or the run copied to another machine), and was refused as a
// --tokenizer that does not load.
TEST(TrainCli, ResumeNeedsNotTheTokenizerFileTheRunStartedWith) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  ASSERT_FALSE(one_step_run(o).empty());
  const std::string tok = dir + "/tok.model", out = dir + "/second";
  fs::copy_file(o.out_dir + "/" + kTokenizerFile, tok);
  auto [rc, err] =
      cli({"--config", o.config_path, "--data", o.data[0], "--out", out, "--tokenizer", tok,
           "--batch-size", "4", "--seq-len", "24", "--threads", "1", "--steps", "1"});
  ASSERT_EQ(rc, 0) << err;
  fs::remove(tok);
  std::tie(rc, err) = cli({"--out", out, "--resume", "--steps", "2"});
  EXPECT_EQ(rc, 0) << err;
}

// A trainer_state.json far larger than any (a damaged file) is refused without reading it whole.
TEST(TrainCli, AHugeTrainerStateIsRefusedUnread) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  const std::string state = one_step_run(o);
  ASSERT_FALSE(state.empty());
  fs::resize_file(state, kMaxTrainerStateBytes + 1);  // sparse: no disk used
  const auto [rc, err] = cli({"--out", o.out_dir, "--resume", "--steps", "2"});
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("'" + state + "' is " + std::to_string(kMaxTrainerStateBytes + 1) +
                     " bytes, more than the " + std::to_string(kMaxTrainerStateBytes) +
                     " such a file can be"),
            std::string::npos)
      << err;
}

// The working directory of a test, restored when it ends.
struct InDirectory {
  explicit InDirectory(const std::string& dir) : before(fs::current_path()) {
    fs::create_directories(dir);
    fs::current_path(dir);
  }
  ~InDirectory() { fs::current_path(before); }
  fs::path before;
};

// `cemlm train` with args, writing the tiny run's --out, on one thread with short windows.
auto tiny_run(const TrainOptions& o, std::vector<std::string> args) {
  args.insert(args.end(),
              {"--out", o.out_dir, "--threads", "1", "--seq-len", "24", "--eval-windows", "4"});
  return cli(args);
}

// --data is saved absolute, so that --resume reads the run's files from any directory; a relative
// one saved by an older cemlm, missing where --resume runs, is refused saying where it came from.
TEST(TrainCli, ResumeFromAnotherDirectoryReadsTheRunsData) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  auto with = [&](const std::vector<std::string>& args) { return tiny_run(o, args); };
  {
    InDirectory in(dir);
    const auto [rc, err] = with({"--config", "config.json", "--data", "./text/", "--steps", "2"});
    ASSERT_EQ(rc, 0) << err;
  }
  // Without the trailing separator: "data/" and "data" are one option.
  EXPECT_EQ(load_run_options(o.out_dir)->data, std::vector<std::string>{dir + "/text"});
  InDirectory elsewhere(dir + "/elsewhere");
  testing_trainer::write_file(dir + "/elsewhere/text/other.txt",
                              testing_trainer::corpus_text(300, 9));  // not the run's
  auto [rc, err] = with({"--resume", "--steps", "3"});
  ASSERT_EQ(rc, 0) << err;
  EXPECT_EQ(load_run_options(o.out_dir)->data, std::vector<std::string>{dir + "/text"});

  // As an older cemlm saved it: relative to where the run started.
  const std::string state_file = o.out_dir + "/trainer_state.json";
  std::string state, error;
  ASSERT_TRUE(read_file(state_file, &state, &error));
  const std::string saved = "\"" + dir + "/text\"";
  ASSERT_NE(state.find(saved), std::string::npos);
  state.replace(state.find(saved), saved.size(), "\"corpus\"");
  testing_trainer::write_file(state_file, state);
  std::tie(rc, err) = with({"--resume", "--steps", "4"});
  EXPECT_EQ(rc, 1);
  EXPECT_NE(err.find("the run saved --data 'corpus' relative to the directory it was started in"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("give --data again"), std::string::npos) << err;
  std::tie(rc, err) = with({"--resume", "--steps", "4", "--data", dir + "/text"});
  EXPECT_EQ(rc, 0) << err;
}

// Paths given again name the same files however they are spelled, and a relative --cache is
// saved absolute (resumed elsewhere, it encoded the data again into a new cache there).
// --resume continues the run it read its options from: without --out, the default's. The state's
// own "out", relative to where that run started, named another run's directory here, which was
// resumed (and saved over) with the first run's options.
TEST(TrainCli, ResumeContinuesTheDirectoryItReadTheRunFrom) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  InDirectory in(dir + "/work");
  const std::vector<std::string> args = {
      "--config", o.config_path, "--data", o.data[0], "--threads",      "1", "--seq-len", "24",
      "--steps",  "2",           "--out",  "runs/a",  "--eval-windows", "4"};
  ASSERT_EQ(cli(args).first, 0);
  const TrainOptions defaults;
  fs::create_directories(fs::path(defaults.out_dir).parent_path());
  fs::copy("runs/a", defaults.out_dir, fs::copy_options::recursive);
  const auto [rc, err] = cli({"--resume", "--steps", "3"});
  ASSERT_EQ(rc, 0) << err;
  EXPECT_EQ(load_run_options(defaults.out_dir)->steps, 3);
  EXPECT_EQ(load_run_options("runs/a")->steps, 2);  // not the run continued
}

TEST(TrainCli, ResumeComparesPathsAsFilesAndKeepsTheCacheAbsolute) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  auto with = [&](const std::vector<std::string>& args) { return tiny_run(o, args); };
  {
    InDirectory in(dir);
    const auto [rc, err] = with(
        {"--config", "config.json", "--data", "text", "--cache", "tokens-cache", "--steps", "2"});
    ASSERT_EQ(rc, 0) << err;
    EXPECT_EQ(load_run_options(o.out_dir)->cache_dir, dir + "/tokens-cache");
    const auto [rc2, err2] = with({"--config", "./sub/../config.json", "--resume", "--steps", "3"});
    EXPECT_EQ(rc2, 0) << err2;
  }
  InDirectory elsewhere(dir + "/elsewhere");
  const auto [rc, err] = with({"--resume", "--steps", "4"});
  ASSERT_EQ(rc, 0) << err;
  EXPECT_FALSE(fs::exists(dir + "/elsewhere/tokens-cache"));
  EXPECT_EQ(load_run_options(o.out_dir)->cache_dir, dir + "/tokens-cache");
}

// --config given again with --resume, its file edited since the run started: the run keeps the
// model it saved, so the edit would be silently lost; it is refused, naming the fields. Given
// again unchanged (with the run's --vocab-size replacing the file's), the run goes on. The run
// compared is the one resumed: here the state's "out" is relative to another directory.
TEST(TrainCli, ResumeRefusesAConfigFileEditedSinceTheRunStarted) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  auto with = [&](const std::vector<std::string>& args) { return tiny_run(o, args); };
  {
    InDirectory in(dir);
    const auto [rc, err] =
        cli({"--config", o.config_path, "--data", o.data[0], "--vocab-size", "320", "--steps", "2",
             "--out", "run", "--threads", "1", "--seq-len", "24", "--eval-windows", "4"});
    ASSERT_EQ(rc, 0) << err;
    ASSERT_EQ(o.out_dir, dir + "/run");
  }
  InDirectory elsewhere(dir + "/elsewhere");
  const std::string original = testing_trainer::tiny_config_json();
  std::string edited = original;
  edited.replace(edited.find("\"max\": 4"), 8, "\"max\": 6");
  testing_trainer::write_file(o.config_path, edited);
  auto [rc, err] = with({"--config", o.config_path, "--resume", "--steps", "3"});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(err.find("--config '" + o.config_path + "' has changed since the run started"),
            std::string::npos)
      << err;
  EXPECT_NE(err.find("(recursion/max differs from the model saved"), std::string::npos) << err;
  EXPECT_EQ(load_run_options(o.out_dir)->steps, 2);  // nothing trained or saved
  testing_trainer::write_file(o.config_path, original);
  std::tie(rc, err) = with({"--config", o.config_path, "--resume", "--steps", "3"});
  EXPECT_EQ(rc, 0) << err;
  // Left out, the run's saved model goes on whatever the file says.
  testing_trainer::write_file(o.config_path, edited);
  std::tie(rc, err) = with({"--resume", "--steps", "4"});
  EXPECT_EQ(rc, 0) << err;
}

// What is wrong in a run's saved state is named: the key, or the flag a saved option stands for
// with where its value came from; keys the state never holds are refused.
TEST(TrainCli, ResumeNamesWhatIsWrongInTheSavedState) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  const auto [rc0, err0] =
      cli({"--config", o.config_path, "--data", o.data[0], "--out", o.out_dir, "--threads", "1",
           "--seq-len", "24", "--eval-windows", "4", "--steps", "2"});
  ASSERT_EQ(rc0, 0) << err0;
  const std::string state_file = o.out_dir + "/" + kTrainerStateFile;
  std::string good, error;
  ASSERT_TRUE(read_file(state_file, &good, &error)) << error;
  auto edited = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) s.replace(at, from.size(), to);
    return s;
  };
  const nlohmann::json j = nlohmann::json::parse(good);
  const std::string step = "\"step\": " + std::to_string(j["step"].get<int64_t>());
  const std::string hash =
      "\"validation_hash\": " + std::to_string(j["validation_hash"].get<uint64_t>());
  const std::string lr = "\"lr\": " + j["options"]["lr"].dump();
  const std::string seed = "\"seed\": " + j["options"]["seed"].dump();
  const std::string data_rng = "\"data_rng\": " + j["data_rng"].dump();
  const std::string windows = "\"eval_windows\": " + j["options"]["eval_windows"].dump();
  const std::string threads = "\"threads\": " + j["options"]["threads"].dump();
  const std::string version = "\"format_version\": " + j["format_version"].dump();
  const std::string config = "\"config\": " + j["options"]["config"].dump();
  // 100000 brackets: printing the saved options recursed once per level and overflowed the stack.
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  struct Case {
    std::string state, message;
  };
  std::vector<Case> cases = {
      {edited(step, "\"step\": \"forty\""), "\"step\": "},
      {edited(step, "\"step\": -3"), "\"step\": must be at least 0"},
      {edited(data_rng, "\"data_rng\": -1"), "\"data_rng\": must be an integer in [0, 2^64)"},
      {edited(step, "\"bogus\": 1, " + step), "unknown key \"bogus\""},
      {edited(lr, "\"lrr\": 0.001, " + lr), "training options: unknown key \"lrr\""},
      // Keys are escaped: a newline in one could forge a line of the trainer's output.
      {edited(step, "\"a\\nb\": 1, " + step), "unknown key \"a\\nb\""},
      {edited(lr, "\"l\\nr\": 0.001, " + lr), "training options: unknown key \"l\\nr\""},
      {edited(absl::StrCat("\"split\": \"", kSplitRule, "\""), "\"split\": 5"),
       "\"split\": must be a string (got 5)"},
      {edited(hash, "\"validation_hash\": -4"),
       "\"validation_hash\": must be an integer in [0, 2^64) (got -4)"},
      {edited(seed, "\"seed\": -1"), "\"seed\": must be an integer in [0, 2^64)"},
      {edited(lr, "\"lr\": 5"),
       "--lr must be in (0, 1] (got 5) (with --resume, each option not given again is the run's, "
       "read from '" +
           o.out_dir + "/trainer_state.json'"},
      // Numbers were converted to the field's type whatever they were: 2.5 steps read as 2 (the
      // optimizer's step, so the run resumed), 2^32 + 4 windows as 4, true as 1 thread.
      {edited(step, "\"step\": 2.5"), "\"step\": must be an integer in [0, 2^63) (got 2.5)"},
      {edited(windows, "\"eval_windows\": 4294967300"),
       "\"eval_windows\": must be an integer in [-2147483648, 2147483647] (got 4294967300)"},
      {edited(threads, "\"threads\": true"), "\"threads\": must be an integer"},
      {edited(version, "\"format_version\": 2"),
       "\"format_version\": is 2, not 1 (the file is from another cemlm version)"},
      {edited(seed, "\"seed\": " + deep), "nested more than 64 arrays/objects deep"},
      {edited(step, "\"step\": 1, " + step), "duplicate key \"step\""},
      {edited(lr, "\"lr\": 1e999"), "the number 1e999 is beyond the range of a 64-bit float"},
      // Said as the field's type, not as nlohmann's "[json.exception.type_error.302]".
      {edited(config, "\"config\": 5"), "\"config\": must be a string (got 5)"},
  };
  // Saved options that only the command line or the run check: said to come from the file too
  // ("--data: input … does not exist" blamed a flag the command did not give), exit 1.
  const std::string from_file =
      " (with --resume, each option not given again is the run's, read "
      "from '" +
      o.out_dir + "/trainer_state.json'";
  auto with_option = [&](const char* key, const nlohmann::json& value) {
    nlohmann::json k = j;
    k["options"][key] = value;
    return k.dump(2);
  };
  // A missing key is said as missing (it leaked nlohmann's "[json.exception.out_of_range.403]").
  nlohmann::json without_clip = j;
  without_clip["options"].erase("clip");
  cases.push_back({without_clip.dump(2), "\"clip\": missing (the file is damaged)"});
  cases.push_back({with_option("eval_recursion", {0, -1}), "--eval-recursion '0,-1'"});
  cases.push_back({with_option("data", {dir + "/nonexistent"}), "--data"});
  cases.push_back({with_option("seq_len", 100000), "--seq-len"});
  // An emptied log lost the run's history silently.
  const std::string metrics_file = o.out_dir + "/" + kMetricsFile;
  std::string metrics;
  ASSERT_TRUE(read_file(metrics_file, &metrics, &error)) << error;
  for (const Case& c : cases) {
    testing_trainer::write_file(state_file, c.state);
    const auto [rc, err] = cli({"--out", o.out_dir, "--resume", "--steps", "3"});
    EXPECT_NE(rc, 0) << c.message;
    EXPECT_NE(err.find(c.message), std::string::npos) << err;
    if (c.message.starts_with("--")) {
      EXPECT_EQ(rc, 1) << err;
      EXPECT_NE(err.find(from_file), std::string::npos) << err;
    }
  }
  testing_trainer::write_file(state_file, good);
  for (const std::string& cut : {std::string(), metrics.substr(0, metrics.find('\n') + 1)}) {
    testing_trainer::write_file(metrics_file, cut);
    const auto [rc, err] = cli({"--out", o.out_dir, "--resume", "--steps", "3"});
    EXPECT_EQ(rc, 1) << err;
    EXPECT_NE(err.find("train.jsonl ends at step " + std::string(cut.empty() ? "0" : "1") +
                       " but " + state_file + " is at step 2"),
              std::string::npos)
        << err;
  }
  testing_trainer::write_file(metrics_file, metrics);
  testing_trainer::write_file(state_file, edited(lr, "\"lr\": 5"));
  const auto [rc, err] = cli({"--out", o.out_dir, "--resume", "--steps", "3", "--lr", "0.001"});
  EXPECT_EQ(rc, 0) << err;  // given again, the flag replaces the bad value
}

TEST(TrainCli, HelpListsEveryFlagWithItsDefault) {
  ::testing::internal::CaptureStdout();
  std::vector<std::string> args = {"--help"};
  std::vector<char*> argv = {args[0].data()};
  EXPECT_EQ(cli::cmd_train(1, argv.data()), 0);
  const std::string help = ::testing::internal::GetCapturedStdout();
  for (const char* flag : {"--out",
                           "--resume",
                           "--config",
                           "--init",
                           "--tokenizer",
                           "--vocab-size",
                           "--data",
                           "--cache",
                           "--val-fraction",
                           "--steps",
                           "--batch-size",
                           "--seq-len",
                           "--accum",
                           "--lr",
                           "--min-lr",
                           "--warmup",
                           "--weight-decay",
                           "--beta1",
                           "--beta2",
                           "--adam-eps",
                           "--clip",
                           "--train-recursion",
                           "--eval-recursion",
                           "--eval-every",
                           "--eval-windows",
                           "--save-every",
                           "--threads",
                           "--seed",
                           "--max-minutes",
                           "--log-every"})
    EXPECT_TRUE(help.find(std::string(flag) + " ") != std::string::npos ||
                help.find(std::string(flag) + "\n") != std::string::npos)
        << flag;
  const std::string recursion = recursion_range_text(TrainOptions{}.train_recursion);
  EXPECT_NE(help.find("(default: \"" + recursion + "\")"), std::string::npos) << help;
  EXPECT_NE(help.find(kDefaultData), std::string::npos);
}

TEST(TrainCli, BadFlagsAreRefusedByName) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  testing_trainer::write_file(dir + "/empty/blank.txt", "\n\n");
  testing_trainer::write_file(dir + "/only_dat/x.dat", "x");
  std::string one_doc = testing_trainer::corpus_text(300, 3);
  std::erase(one_doc, '%');
  testing_trainer::write_file(dir + "/one_doc/a.txt", one_doc);
  const std::vector<std::string> base = {"--config",  o.config_path, "--out",     dir + "/bad",
                                         "--steps",   "2",           "--threads", "1",
                                         "--seq-len", "24"};
  // Exit 2 for a value wrong in itself (a usage error); 1 for one wrong for the model or data.
  struct Case {
    std::vector<std::string> args;
    std::string flag;
    int rc = 2;
  };
  const std::vector<Case> cases = {
      {{"--lr", "-1"}, "--lr"},
      {{"--lr", "0"}, "--lr"},
      {{"--min-lr", "1"}, "--min-lr"},
      {{"--train-recursion", "0-3"}, "--train-recursion"},
      {{"--train-recursion", "4-1"}, "--train-recursion"},
      {{"--train-recursion", "1-5"},
       "--train-recursion",
       1},  // the tiny model's recursion.max is 4
      {{"--train-recursion", "x"}, "--train-recursion"},
      {{"--eval-recursion", "1,0"}, "--eval-recursion"},
      {{"--eval-recursion", "5,6"}, "--eval-recursion", 1},
      {{"--steps", "0"}, "--steps"},
      {{"--batch-size", "0"}, "--batch-size"},
      {{"--seq-len", "1"}, "--seq-len"},
      {{"--seq-len", "65"}, "--seq-len", 1},  // above max_seq_len
      {{"--accum", "0"}, "--accum"},
      // The tokenizer the run trains could not have so few pieces (it was exit 1, as the
      // config's vocab_size once the model was set up).
      {{"--vocab-size", "100"}, "--vocab-size 100 is too small: the special and byte-fallback"},
      {{"--vocab-size", "1"}, "--vocab-size 1 is too small"},
      // Past any machine's memory: refused before the tokenizer and the data, not grown into
      // until the kernel's out-of-memory killer ends the run.
      {{"--batch-size", "2000000000"},
       "out of memory: the activations of --batch-size 2000000000 × --seq-len 24 at T up to 2 "
       "take at least ",
       1},
      {{"--warmup", "-1"}, "--warmup"},
      {{"--weight-decay", "-0.1"}, "--weight-decay"},
      // lr·wd ≥ 1 would flip or zero the weights; wd ≥ 1 alone is fine (see below).
      {{"--lr", "0.5", "--weight-decay", "2"},
       "--weight-decay must be at least 0 with --lr x --weight-decay below 1"},
      {{"--clip", "-1"}, "--clip"},
      {{"--beta2", "1"}, "--beta2"},
      {{"--beta1", "0.99999999999"}, "--beta1"},  // 1 as a float (AdamW's arithmetic)
      {{"--beta2", "0.99999999999"}, "--beta2"},
      {{"--adam-eps", "1e-50"}, "--adam-eps"},  // 0 as a float
      {{"--val-fraction", "0"}, "--val-fraction"},
      // Quoted as given: with 6 digits, "must be in (0, 0.5] (got 0.5)".
      {{"--val-fraction", "0.5000001"}, "--val-fraction must be in (0, 0.5] (got 0.5000001)"},
      {{"--lr", "1.0000001"}, "--lr must be in (0, 1] (got 1.0000001)"},
      // The bound named as --lr, the value quoted (it said only "must be in [0, 0.0001]").
      {{"--lr", "1e-4", "--min-lr", "2e-4"},
       "--min-lr must be in [0, --lr] = [0, 1e-04] (got 2e-04)"},
      {{"--eval-every", "0"}, "--eval-every"},
      {{"--save-every", "0"}, "--save-every"},
      {{"--max-minutes", "-1"}, "--max-minutes"},
      {{"--threads", "-2"}, "--threads"},
      {{"--threads", "100000"}, "--threads must be in [0, 1024]"},
      {{"--log-every", "0"}, "--log-every"},
      {{"--init", dir + "/nothing"}, "--config"},  // both given
      {{"--steps", "many"}, "--steps"},
      {{"--lr", "0x10"}, "--lr"},  // strtod read hex: 16
      {{"--lr", " 0.001"}, "--lr"},
      {{"--seed", "-1"}, "--seed"},  // wrapped to 2^64 - 1 before
      {{"--eval-recursion", "2,1,2"}, "--eval-recursion"},
      // A save replaces --out whole: a cache there is refused before training, not at the save.
      {{"--cache", dir + "/bad"}, "--cache", 1},
      {{"--cache", dir + "/bad/cache"}, "--cache", 1},
      {{"--data", dir + "/missing"}, "--data", 1},
      {{"--data", dir + "/empty"}, "--data", 1},
      {{"--data", dir + "/only_dat"}, "--data", 1},
      // One document (the split cannot move to a document start): no validation window.
      {{"--data", dir + "/one_doc", "--seq-len", "64", "--val-fraction", "0.001"}, "--seq-len", 1},
  };
  for (const Case& c : cases) {
    auto args = base;
    args.insert(args.end(), c.args.begin(), c.args.end());
    if (std::find(c.args.begin(), c.args.end(), "--data") == c.args.end())
      args.insert(args.end(), {"--data", o.data[0]});
    const auto [rc, err] = cli(args);
    EXPECT_EQ(rc, c.rc) << c.args[0] << " " << c.args[1] << ": " << err;
    EXPECT_NE(err.find(c.flag), std::string::npos) << c.args[0] << " " << c.args[1] << ": " << err;
    EXPECT_FALSE(fs::exists(dir + "/bad/config.json")) << c.args[0] << " " << c.args[1];
  }
  // Refused for a flag once the model is loaded, or for its data: --out's missing parents (and
  // its lock file) are not left behind.
  for (const auto& [data, flag] :
       {std::pair{o.data[0], "--seq-len"}, {dir + "/only_dat", "--data"}}) {
    const auto [rc, err] =
        cli({"--config", o.config_path, "--out", dir + "/new/sub/run", "--data", data, "--steps",
             "2", "--threads", "1", "--seq-len", std::string(flag) == "--seq-len" ? "65" : "24"});
    EXPECT_NE(rc, 0);
    EXPECT_NE(err.find(flag), std::string::npos) << err;
    EXPECT_FALSE(fs::exists(dir + "/new")) << flag;
  }
  const auto [rc, err] = cli({"--out", dir + "/never-trained", "--resume"});
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("--resume"), std::string::npos) << err;
  // "--data $EMPTY" is refused, not read as the default corpus; a boolean takes no value.
  auto args = base;
  args.push_back("--data");
  auto [rc2, err2] = cli(args);
  EXPECT_NE(rc2, 0);
  EXPECT_NE(err2.find("option '--data' needs at least one value"), std::string::npos) << err2;
  // Nor is an empty path the default's: "--init $CKPT" with CKPT unset trained a new model.
  for (const char* flag : {"--init", "--config", "--tokenizer", "--cache"}) {
    auto empty = base;
    empty.insert(empty.end(), {"--data", o.data[0], flag, ""});
    std::tie(rc2, err2) = cli(empty);
    EXPECT_EQ(rc2, 2) << flag;
    EXPECT_NE(err2.find(std::string(flag) + " is empty: name "), std::string::npos) << err2;
    EXPECT_FALSE(fs::exists(dir + "/bad/config.json")) << flag;
  }
  args.insert(args.end(), {o.data[0], "--resume=no"});
  std::tie(rc2, err2) = cli(args);
  EXPECT_NE(rc2, 0);
  EXPECT_NE(err2.find("option '--resume' takes no value"), std::string::npos) << err2;
  // An integer past its type's range says the range (it said only "expected an integer").
  for (const auto& [flag, value, says] :
       {std::tuple{"--batch-size", "99999999999", "[-2147483648, 2147483647]"},
        std::tuple{"--steps", "99999999999999999999", "[-2^63, 2^63)"}}) {
    auto huge = base;
    huge.insert(huge.end(), {"--data", o.data[0], flag, value});
    std::tie(rc2, err2) = cli(huge);
    EXPECT_EQ(rc2, 2) << flag;
    EXPECT_NE(err2.find(absl::StrCat("option '", flag, "': expected an integer in ", says,
                                     ", got '", value, "'")),
              std::string::npos)
        << err2;
  }
}

// AdamW computes in 32-bit floats: values that pass the range checks as doubles but vanish or
// round to 1 as floats are refused by name, saying what to use (eps 1e-50 became 0: NaN for an
// embedding row never seen, reported as a divergence; β 0.99999999999 became 1: a moment that
// never moves, and with β1 a run that "succeeded" without changing a weight).
// Weight decay is bounded by what it does, 1 − lr·wd per step, not by 1: PyTorch's usual values
// of 1 and more are taken at a small --lr (they were refused as outside [0, 1)).
TEST(TrainOptions, WeightDecayIsBoundedByLrTimesDecay) {
  TrainOptions o = tiny_options(fresh_dir());
  o.lr = 1e-3;
  for (const auto& [wd, ok] : {std::pair{0.0, true},
                               {1.0, true},
                               {10.0, true},
                               {999.0, true},
                               {1000.0, false},
                               {-0.1, false}}) {
    o.adamw.weight_decay = wd;
    const absl::Status st = validate_options(o);
    EXPECT_EQ(st.ok(), ok) << wd << ": " << st;
    if (!ok) {
      EXPECT_NE(std::string(st.message()).find("--weight-decay must be at least 0 with --lr x"),
                std::string::npos)
          << st;
    }
  }
}

TEST(TrainOptions, AdamValuesAFloatCannotHoldAreRefusedByName) {
  const TrainOptions base = tiny_options(fresh_dir());
  ASSERT_TRUE(validate_options(base).ok());
  struct Case {
    const char* flag;
    double AdamWOptions::*field;
    double value;
    bool ok;
  };
  const double halfway = 1.0 - 0x1p-25;  // between 1 and the float below it: rounds to 1
  const std::vector<Case> cases = {
      {"--adam-eps", &AdamWOptions::eps, 1e-50, false},
      {"--adam-eps", &AdamWOptions::eps, FLT_MIN / 4, false},  // subnormal
      {"--adam-eps", &AdamWOptions::eps, FLT_MIN, true},
      {"--beta1", &AdamWOptions::beta1, 0.99999999999, false},
      {"--beta1", &AdamWOptions::beta1, halfway, false},
      {"--beta1", &AdamWOptions::beta1, std::nextafter(halfway, 0.0), true},
      {"--beta2", &AdamWOptions::beta2, 0.99999999999, false},
      {"--beta2", &AdamWOptions::beta2, halfway, false},
      {"--beta2", &AdamWOptions::beta2, std::nextafter(halfway, 0.0), true},
  };
  for (const Case& c : cases) {
    TrainOptions o = base;
    o.adamw.*c.field = c.value;
    const absl::Status st = validate_options(o);
    EXPECT_EQ(st.ok(), c.ok) << c.flag << " " << c.value;
    if (c.ok) continue;
    const std::string error(st.message());
    EXPECT_EQ(error.find(std::string(c.flag) + " "), 0u) << error;
    const bool eps = std::string(c.flag) == "--adam-eps";
    EXPECT_NE(error.find(eps ? "too small for a 32-bit float" : "rounds to 1 as a 32-bit float"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find(eps ? "raise it" : "use at most 0.99999994"), std::string::npos) << error;
  }
  // The learning rate is a float there too: 1e-50 would be 0, and nothing would train.
  TrainOptions o = base;
  o.lr = 1e-50;
  o.min_lr = 0;
  const absl::Status st = validate_options(o);
  EXPECT_NE(st.message().find("--lr 1e-50 is too small for a 32-bit float"), std::string::npos)
      << st;
}

// The same values given again with --resume (which overrides the saved options) are refused too,
// before anything trains.
TEST(TrainCli, AdamValuesAFloatCannotHoldAreRefusedOnResume) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  const auto [rc, err] =
      cli({"--config", o.config_path, "--data", o.data[0], "--out", o.out_dir, "--steps", "1",
           "--threads", "1", "--seq-len", "24", "--eval-windows", "2", "--eval-recursion", "1"});
  ASSERT_EQ(rc, 0) << err;
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--adam-eps", "1e-50"}, {"--beta1", "0.99999999999"}, {"--beta2", "0.99999999999"}}) {
    const auto [resumed, error] =
        cli({"--out", o.out_dir, "--resume", "--steps", "2", flag, value});
    EXPECT_EQ(resumed, 2) << flag;  // given on the command line: a usage error
    EXPECT_NE(error.find("error: " + flag + " "), std::string::npos) << error;
  }
  EXPECT_EQ(load_run_options(o.out_dir)->steps, 1);  // nothing ran
}

// An --out that exists but is no checkpoint (nor empty) is refused before any training, not at
// the first save after all of it.
TEST(TrainCli, OutThatIsNoCheckpointIsRefusedBeforeTraining) {
  const std::string dir = fresh_dir();
  const TrainOptions o = tiny_options(dir);
  testing_trainer::write_file(dir + "/notes/todo.txt", "not a model\n");
  const auto [rc, err] = cli({"--config", o.config_path, "--out", dir + "/notes", "--data",
                              o.data[0], "--steps", "2", "--threads", "1", "--seq-len", "24"});
  EXPECT_NE(rc, 0);
  EXPECT_NE(err.find("--out: '" + dir + "/notes' exists and is not a checkpoint directory"),
            std::string::npos)
      << err;
  EXPECT_EQ(err.find("tokenizer: training"), std::string::npos) << err;  // nothing was done
  EXPECT_TRUE(fs::exists(dir + "/notes/todo.txt"));
}

}  // namespace
}  // namespace cemlm
