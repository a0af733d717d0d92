// `cemlm train`: flags → TrainOptions (with --resume, the run's saved options, overridden only
// by the flags given again), then the training loop with a live progress line on a terminal,
// plain lines otherwise, and a clean stop-and-save on Ctrl-C or SIGTERM.
#include "cemlm/trainer/train.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cemlm/cli/commands.h"
#include "cemlm/cli/flags.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/config.h"
#include "cemlm/engine/cpu_threads.h"
#include "nlohmann/json.hpp"

namespace cemlm::cli {
namespace {

// SIGINT (Ctrl-C), SIGTERM (docker stop, a Kubernetes Job's eviction) or SIGHUP (the terminal or
// ssh session closed): finish the step, save, exit with 128 + the signal's number; during setup
// (tokenizer, data), stop once the current part is done, with nothing trained or saved. A second
// SIGINT or SIGTERM ends the process at once (checkpoints are written atomically, so the last one
// stays whole); SIGHUPs after the first signal are ignored: a closed terminal sends two (bash
// forwards one, the kernel sends another to the foreground group), and the second killed the run
// before it saved.
std::atomic<int> g_stop_signal{0};  // lock-free: safe in a handler, on whichever thread
static_assert(std::atomic<int>::is_always_lock_free);
// kStopAsked by the handler, kTraining by the last check before the first step: set in one
// atomic, so that whichever comes first decides both the handler's note and what the run does.
constexpr int kStopAsked = 1, kTraining = 2;
std::atomic<int> g_state{0};

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};
// Those of kStopSignals this run handles (a bit each): one the process started with ignored
// stays ignored, as `nohup cemlm train …` (SIGHUP) and a background job of a script (SIGINT)
// expect; the handler replaced that, and a closed terminal stopped a nohup'ed run.
std::atomic<unsigned> g_handled{0};
static_assert(std::atomic<unsigned>::is_always_lock_free);

void on_stop_signal(int sig) {
  g_stop_signal = sig;
  for (int s : kStopSignals)
    if (g_handled.load() & (1u << s)) std::signal(s, s == SIGHUP ? SIG_IGN : SIG_DFL);
  static const char kSaving[] =
      "\nstopping: saving after the current step (Ctrl-C or SIGTERM again quits at once)\n";
  static const char kNothing[] =
      "\nstopping before training, once the tokenizer or data in preparation is done: nothing "
      "trained, nothing saved (Ctrl-C or SIGTERM again quits at once)\n";
  if (g_state.fetch_or(kStopAsked) & kTraining)
    (void)!::write(2, kSaving, sizeof(kSaving) - 1);
  else
    (void)!::write(2, kNothing, sizeof(kNothing) - 1);
}

// Flag values that are not TrainOptions fields as they stand.
struct FlagText {
  std::vector<std::string> data;  // empty: keep TrainOptions::data
  std::string train_recursion, eval_recursion;
  int log_every = 10;
};

std::string duration(double s) {
  const int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return absl::StrCat(t / 3600, "h", (t / 60) % 60, "m");
  return t >= 60 ? absl::StrCat(t / 60, "m", t % 60, "s") : absl::StrCat(t, "s");
}

// Declares every flag with `o`'s current values as defaults, then parses argv into o and t.
int parse_flags(int argc, char** argv, TrainOptions& o, FlagText& t) {
  t.train_recursion = recursion_range_text(o.train_recursion);
  t.eval_recursion = absl::StrJoin(o.eval_recursion, ",");
  Flags f(
      "cemlm train [--out DIR] [--config FILE | --init DIR] [--data PATH...] [options]",
      "Train a CEM/Leviathan language model on UTF-8 text and write a checkpoint directory\n"
      "(config.json, model.safetensors, tokenizer.model, optimizer and trainer state,\n"
      "train.jsonl, loss.svg) every --save-every steps and at the end, atomically.\n"
      "With no model flags: the default small CEM model on Debian's fortunes (docs/TRAINING.md).\n"
      "Ctrl-C, SIGTERM or SIGHUP finishes the step, saves, and exits with 130, 143 or 129;\n"
      "--resume goes on. Before the first step (the tokenizer or data setup), it stops\n"
      "saving nothing.\n"
      "A signal ignored at the start stays ignored (nohup: SIGHUP).");
  f.add("out", &o.out_dir,
        "checkpoint directory to write, by one run at a time (locked with .<name>.lock beside "
        "it)");
  f.add_bool("resume", &o.resume,
             "continue the run saved in --out (same options unless given again; bit-exact)");
  // Empty, these meant their defaults: "--init $CKPT" with CKPT unset trained a new model.
  f.add_nonempty("config", &o.config_path,
                 "model config.json (default: the built-in small CEM model)",
                 "name a config.json, or leave the flag out for the built-in small model");
  f.add_nonempty("init", &o.init_dir, "start from this checkpoint's config, weights and tokenizer",
                 "name a checkpoint directory, or leave the flag out to train a new model");
  f.add_nonempty(
      "tokenizer", &o.tokenizer_path,
      "SentencePiece model to use when the model has none (default: train one on --data)",
      "name a .model file, or leave the flag out to train one on --data");
  f.add("vocab-size", &o.vocab_size,
        "vocabulary of a new model and of the tokenizer trained for it (0: the config's)");
  f.add_list("data", &t.data,
             std::string("UTF-8 text files or directories (walked recursively; .dat/.u8, and "
                         "directories of another run's checkpoint or token cache, left out, and "
                         "refused when named; a line '%' separates documents) (default: ") +
                 kDefaultData + ")");
  f.add_nonempty("cache", &o.cache_dir,
                 "token and tokenizer cache directory (default: <out>.cache)",
                 "name a directory, or leave the flag out for <out>.cache");
  f.add("val-fraction", &o.val_fraction,
        "share of each file's tokens (its end) held out for validation");
  f.add("steps", &o.steps, "optimizer updates in the whole run");
  f.add("batch-size", &o.batch_size, "sequences per micro-batch");
  f.add("seq-len", &o.seq_len, "tokens per sequence (at most the model's max_seq_len)");
  f.add("accum", &o.accum,
        "micro-batches accumulated per update (update = batch-size × accum rows)");
  f.add("lr", &o.lr, "peak learning rate, reached after --warmup steps");
  f.add("min-lr", &o.min_lr,
        "learning rate at the end of the cosine decay (left out of a new run: --lr / 10)");
  f.add("warmup", &o.warmup, "linear warmup steps");
  f.add("weight-decay", &o.adamw.weight_decay,
        "AdamW decoupled weight decay (matrices only): at least 0, with --lr x it below 1");
  f.add("beta1", &o.adamw.beta1, "AdamW first-moment decay");
  f.add("beta2", &o.adamw.beta2, "AdamW second-moment decay");
  f.add("adam-eps", &o.adamw.eps, "AdamW epsilon");
  f.add("clip", &o.clip, "clip the global gradient norm to this (0: no clipping)");
  f.add("train-recursion", &t.train_recursion,
        "recursion depth T in training: fixed (2) or drawn per step from a range (1-4)");
  f.add("eval-recursion", &t.eval_recursion,
        "depths T at which validation loss is measured (those above recursion.max are skipped)");
  f.add("eval-every", &o.eval_every, "evaluate every N steps (and at the end)");
  f.add("eval-windows", &o.eval_windows, "validation sequences per evaluation (at most)");
  f.add("save-every", &o.save_every, "checkpoint every N steps (and at the end)");
  f.add("threads", &o.threads, kThreadsHelp);
  f.add("seed", &o.seed, "seed of the initial weights, the data order and the drawn T");
  f.add("max-minutes", &o.max_minutes,
        "stop cleanly (evaluate, save) before this wall-clock budget, set-up included, is spent "
        "(0: none)");
  f.add("log-every", &t.log_every, "print a progress line every N steps when not on a terminal");
  if (int rc = f.parse(argc, argv); rc >= 0) return rc;
  if (!t.data.empty()) o.data = t.data;
  // A tenth of --lr, as the defaults are: `--lr 1e-4` alone was refused for the fixed 3e-4.
  // (A resumed run keeps its own, as every option not given again.)
  // To 15 digits: --lr 0.003 / 10 is 0.00030000000000000003 in binary, which messages quoted.
  // (strtod, which does not throw: a tenth of a tiny --lr may be below a double's normal range,
  // which validation then refuses by name.)
  if (!o.resume && !f.given("min-lr"))
    o.min_lr = std::strtod(absl::StrFormat("%.15g", o.lr / 10).c_str(), nullptr);
  return -1;
}

// Runs of older cemlm versions saved --data as given, relative to the directory they started in:
// resumed from another, such a path may be missing, or name other files. False (with the error
// printed) when one is missing; a note for one that is found.
bool saved_data_found(const std::vector<std::string>& data) {
  std::error_code ec;
  const std::string here = std::filesystem::current_path(ec).string();
  for (const std::string& p : data) {
    if (std::filesystem::path(p).is_absolute()) continue;
    if (!std::filesystem::exists(p, ec)) {
      std::fprintf(stderr,
                   "error: --resume: the run saved --data '%s' relative to the directory it was "
                   "started in (older cemlm versions did), and '%s' has no '%s': run from that "
                   "directory, or give --data again with the run's files\n",
                   p.c_str(), here.c_str(), p.c_str());
      return false;
    }
    std::printf(
        "note: the run saved --data '%s' relative to the directory it was started in "
        "(older cemlm versions did); reading it in '%s' (if the run started elsewhere, "
        "stop and give --data again with its files)\n",
        p.c_str(), here.c_str());
  }
  return true;
}

// Whether two paths name the same file: runs save theirs absolute, and `--config ./c.json` given
// again names the run's `c.json` as well.
bool same_path(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return a == b;
  std::error_code ec;
  const auto resolved = [&](const std::string& p) {
    return std::filesystem::weakly_canonical(std::filesystem::absolute(p, ec), ec);
  };
  return resolved(a) == resolved(b);
}

// Whether `flag` ("--lr") is on the command line, as "--lr X" or "--lr=X".
bool given(const std::string& flag, int argc, char** argv) {
  return std::any_of(argv, argv + argc, [&](const char* a) {
    const std::string_view arg = a;
    return arg == flag || arg.starts_with(flag + "=");
  });
}

// --config given again with --resume names the run's file, but the run keeps the model it saved
// in --out: a file edited since describes another model, which resuming would silently not
// train. False (with the error printed: the fields that differ) when the file's model is not the
// run's. A file that does not load is the run's no more than an edited one.
// `config_path` is the run's (saved absolute), `vocab_size` its --vocab-size, `out_dir` the
// directory resumed (the state's own "out" may name another run's).
bool config_file_is_the_runs(const std::string& config_path, int vocab_size,
                             const std::string& out_dir) {
  absl::StatusOr<ModelConfig> file = load_config(config_path);
  if (file.ok() && vocab_size > 0) {  // the run's --vocab-size replaced the file's
    file->vocab_size = vocab_size;
    file = parse_config(config_to_json(*file));
  }
  if (!file.ok()) {
    std::fprintf(stderr,
                 "error: --config: %s; --resume continues the run's saved model (its "
                 "config.json in --out): leave --config out\n",
                 std::string(file.status().message()).c_str());
    return false;
  }
  const absl::StatusOr<ModelConfig> run = load_checkpoint_config(out_dir);
  if (!run.ok()) return true;  // the training reports what is wrong with the checkpoint
  const nlohmann::json was = nlohmann::json::parse(config_to_json(*run));
  const nlohmann::json now = nlohmann::json::parse(config_to_json(*file));
  std::vector<std::string> changed;
  for (const nlohmann::json& op : nlohmann::json::diff(was, now))
    changed.push_back(op.at("path").get<std::string>().substr(1));
  if (changed.empty()) return true;
  std::fprintf(stderr,
               "error: --config '%s' has changed since the run started (%s %s from the "
               "model saved in --out): --resume continues the run's model as saved; leave "
               "--config out, or start a new run with the file (another --out)\n",
               config_path.c_str(), absl::StrJoin(changed, ", ").c_str(),
               changed.size() == 1 ? "differs" : "differ");
  return false;
}

// An error about an option (its message starts with the flag: "--lr must be …", "--data: …"):
// with --resume, a flag not given on this command line has the run's saved value, so the message
// says so. True when that is the case (the bad value is the file's, not a usage error).
bool print_option_error(absl::string_view message, const TrainOptions& o, int argc, char** argv) {
  const std::string flag(message.substr(0, message.find_first_of(" :")));
  const bool saved = o.resume && flag.starts_with("--") && !given(flag, argc, argv);
  if (saved)
    std::fprintf(stderr,
                 "error: %.*s (with --resume, each option not given again is the run's, read "
                 "from '%s/%s'; give it again to replace it)\n",
                 int(message.size()), message.data(), o.out_dir.c_str(), kTrainerStateFile);
  else
    std::fprintf(stderr, "error: %.*s\n", int(message.size()), message.data());
  return saved;
}

// Whether --vocab-size `given` with --resume is the run's: its saved one, or, where it saved 0 (the
// config's or --init's vocabulary), the model's in `out_dir`.
bool same_vocab_size(int given, int saved, const std::string& out_dir) {
  if (given == saved) return true;
  if (saved != 0) return false;
  const auto model = load_checkpoint_config(out_dir);
  return model.ok() && model->vocab_size == given;
}

// TrainOptions from argv; with --resume, the saved run's options overridden by the flags given.
int options_from_flags(int argc, char** argv, TrainOptions& o, FlagText& t) {
  if (int rc = parse_flags(argc, argv, o, t); rc >= 0) return rc;
  if (o.resume) {
    int64_t done = 0;
    auto saved = load_run_options(o.out_dir, &done);
    if (!saved.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(saved.status().message()).c_str());
      return 1;
    }
    // The run continued is the one read: the state's own "out" (as given when it started,
    // maybe relative to another directory) could name another run's directory here.
    const std::string out_dir = o.out_dir;
    o = *saved;
    o.out_dir = out_dir;
    t = FlagText{};
    if (int rc = parse_flags(argc, argv, o, t); rc >= 0) return rc;
    // What makes the run the run it is may be given again (the same command with --resume), but
    // not changed: it would not continue the run (and was once ignored, yet saved as applied).
    const std::pair<const char*, bool> same[] = {
        {"--config", same_path(o.config_path, saved->config_path)},
        {"--init", same_path(o.init_dir, saved->init_dir)},
        {"--tokenizer", same_path(o.tokenizer_path, saved->tokenizer_path)},
        {"--vocab-size", same_vocab_size(o.vocab_size, saved->vocab_size, o.out_dir)},
        {"--seed", o.seed == saved->seed}};
    for (const auto& [flag, unchanged] : same)
      if (!unchanged) {
        std::fprintf(stderr,
                     "error: %s differs from the run that --resume continues (its model, "
                     "tokenizer and seed are saved in --out); leave it out, or start a new run "
                     "(--init DIR starts from its weights)\n",
                     flag);
        return 2;
      }
    // Given again as the run has them in effect, they are the run's: kept as saved (they were
    // said to differ, and saved as changed: --vocab-size N where the run saved 0 for the model's
    // own N; --cache naming the default '<out>.cache').
    o.vocab_size = saved->vocab_size;
    auto cache_of = [&](const TrainOptions& r) {
      return r.cache_dir.empty() ? checkpoint_target_path(out_dir).string() + ".cache"
                                 : r.cache_dir;
    };
    if (same_path(cache_of(o), cache_of(*saved))) o.cache_dir = saved->cache_dir;
    // Fewer steps than the run did cannot be trained to (as many: it says so and ends, exit 0).
    if (given("--steps", argc, argv) && o.steps < done) {
      std::fprintf(stderr,
                   "error: --steps %lld is below the %lld steps the run in '%s' already did: give "
                   "more to train further, or leave --steps out to finish the run's own %lld\n",
                   (long long)o.steps, (long long)done, o.out_dir.c_str(), (long long)saved->steps);
      return 2;
    }
    if (given("--config", argc, argv) &&
        !config_file_is_the_runs(saved->config_path, saved->vocab_size, o.out_dir))
      return 2;
    if (t.data.empty() && !saved_data_found(o.data)) return 1;
  }
  // A saved value that is wrong (the state file edited, or written by another version) is named
  // as the flag it stands for, and said to come from there: exit 1, no usage error.
  auto range = parse_recursion_range(t.train_recursion);
  if (!range.ok()) return print_option_error(range.status().message(), o, argc, argv) ? 1 : 2;
  o.train_recursion = *range;
  auto eval = parse_recursion_list(t.eval_recursion);
  if (!eval.ok()) return print_option_error(eval.status().message(), o, argc, argv) ? 1 : 2;
  o.eval_recursion = *eval;
  if (t.log_every < 1) {
    std::fprintf(stderr, "error: --log-every must be at least 1 (got %d)\n", t.log_every);
    return 2;
  }
  // (train() checks them again, and refuses those given here in the same words.)
  if (const absl::Status st = validate_options(o); !st.ok())
    return print_option_error(st.message(), o, argc, argv) ? 1 : 2;
  return -1;
}

// Progress on stdout: one redrawn line on a terminal, a line every `log_every` steps otherwise.
class Progress {
 public:
  Progress(int64_t steps, int log_every)
      : steps_(steps), log_every_(log_every), tty_(::isatty(::fileno(stdout))) {}

  void line(const std::string& text) {
    std::printf("%s%s\n", drawn_ ? "\r\033[K" : "", text.c_str());
    drawn_ = false;
    std::fflush(stdout);
  }
  // Ends a redrawn line, so that what follows starts on its own line.
  void finish() {
    if (drawn_) std::printf("\n");
    drawn_ = false;
    std::fflush(stdout);
  }
  void step(const StepMetrics& m) {
    const std::string text = absl::StrFormat(
        "step %lld/%lld  loss %.4f  T %d  lr %.2e  |g| %.3f  %.0f tok/s  elapsed %s  ETA %s",
        (long long)m.step, (long long)steps_, m.loss, m.T, m.lr, m.grad_norm, m.tokens_per_s,
        duration(m.elapsed_s), duration(m.eta_s));
    if (tty_) {
      std::printf("\r\033[K%s", text.c_str());
      drawn_ = true;
      std::fflush(stdout);
    } else if (m.step % log_every_ == 0 || m.step == steps_) {
      line(text);
    }
  }

 private:
  int64_t steps_;
  int log_every_;
  bool tty_, drawn_ = false;
};

std::string eval_text(const EvalMetrics& e) {
  std::string out = absl::StrCat("eval at step ", e.step, ": validation loss (perplexity)");
  for (const auto& [T, nll] : e.loss)
    absl::StrAppend(&out, absl::StrFormat("  T=%d %.4f (%.2f)", T, nll, std::exp(nll)));
  return out;
}

}  // namespace

int cmd_train(int argc, char** argv) {
  TrainOptions opts;
  FlagText text;
  if (int rc = options_from_flags(argc, argv, opts, text); rc >= 0) return rc;
  Progress progress(opts.steps, text.log_every);
  TrainCallbacks cb;
  cb.on_info = [&](const std::string& s) { progress.line(s); };
  cb.on_step = [&](const StepMetrics& m) {
    progress.step(m);
    if (g_stop_signal) progress.line(absl::StrCat("interrupted: saving at step ", m.step));
    return !g_stop_signal;
  };
  cb.stop_before_training = [](bool last) {
    return ((last ? g_state.fetch_or(kTraining) : g_state.load()) & kStopAsked) != 0;
  };
  cb.stop_after = [&](int64_t step, bool saved) {
    if (g_stop_signal)
      progress.line(absl::StrCat("interrupted: ", saved ? "saved" : "saving", " at step ", step));
    return g_stop_signal != 0;
  };
  cb.on_eval = [&](const EvalMetrics& e) { progress.line(eval_text(e)); };
  cb.on_save = [&](int64_t step, const std::string& dir) {
    progress.line(absl::StrCat("saved ", dir, " at step ", step));
  };
  g_stop_signal = 0;
  g_state = 0;
  g_handled = 0;
  for (int s : kStopSignals)
    if (struct sigaction was{}; ::sigaction(s, nullptr, &was) == 0 && was.sa_handler != SIG_IGN) {
      g_handled.fetch_or(1u << s);
      std::signal(s, on_stop_signal);
    }
  // Output piped to `tee` or `head`: Ctrl-C ends the reader too, and the next progress line
  // would have ended the run with SIGPIPE before its save. Writes to a closed pipe just fail
  // (to the end of the command: its last lines come after the save).
  std::signal(SIGPIPE, SIG_IGN);
  auto summary = train(opts, cb);
  for (int s : kStopSignals)
    if (g_handled.load() & (1u << s)) std::signal(s, SIG_DFL);
  progress.finish();
  if (!summary.ok()) {
    print_option_error(summary.status().message(), opts, argc, argv);
    return 1;
  }
  if (summary->finished) return 0;  // a signal during the last step or save changes nothing
  if (summary->step > 0)
    progress.line(absl::StrCat("stopped at step ", summary->step, " of ", opts.steps,
                               ": continue with cemlm train --out ", opts.out_dir, " --resume"));
  // Like a process the signal ended, so that `cemlm train … && cemlm serve …` stops here.
  return g_stop_signal ? 128 + g_stop_signal : 0;
}

}  // namespace cemlm::cli
