// The training loop behind `cemlm train`: options (one field per flag), the run itself with
// evaluation, metrics and atomic checkpoints, and bit-exact resumption. The loop does no
// terminal IO: it reports through TrainCallbacks, and the CLI draws progress.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/config.h"
#include "cemlm/trainer/metrics.h"
#include "cemlm/trainer/optimizer.h"

namespace cemlm {

inline constexpr char kDefaultData[] = "/usr/share/games/fortunes";

// Training recursion: T drawn uniformly from [min, max] each step (min == max: fixed T).
struct RecursionRange {
  int min = 2, max = 2;
};
// "2" or "1-4"; errors name --train-recursion.
absl::StatusOr<RecursionRange> parse_recursion_range(const std::string& text);
std::string recursion_range_text(const RecursionRange& r);
// "1,2,4,8"; errors name --eval-recursion.
absl::StatusOr<std::vector<int>> parse_recursion_list(const std::string& text);

struct TrainOptions {
  // Model: --init checkpoint, else --config file, else default_model_config().
  std::string config_path, init_dir;
  std::string tokenizer_path;  // used when the model has no tokenizer; else one is trained
  int vocab_size = 0;          // for a trained tokenizer; 0: the config's vocab_size
  // Data.
  std::vector<std::string> data = {kDefaultData};
  std::string cache_dir;  // "": <out_dir>.cache
  double val_fraction = 0.05;
  // Output.
  std::string out_dir = "models/default";
  bool resume = false;
  int64_t save_every = 200;
  // Optimisation.
  int64_t steps = 600;
  int batch_size = 16, seq_len = 128, accum = 1;
  double lr = 3e-3, min_lr = 3e-4;
  int64_t warmup = 50;
  AdamWOptions adamw;
  double clip = 1.0;
  RecursionRange train_recursion;
  // Evaluation.
  std::vector<int> eval_recursion = {1, 2, 4, 8};
  int64_t eval_every = 200;
  int eval_windows = 64;
  // Machine.
  int threads = 0;  // 0: as cpu_threads(0): OMP_NUM_THREADS, else the CPUs the process may use
  uint64_t seed = 1;
  double max_minutes = 0;  // the run's wall-clock budget, set-up included; 0: none
};

// What --max-minutes must leave room for after each step: the step's own periodic evaluation
// and save, the next step, then the final evaluation and save (a stop evaluates and saves).
struct TimeBudget {
  double step_s = 0;  // a training step (the mean so far)
  double eval_s = 0;  // an evaluation (the last one, or an estimate before the first)
  double save_s = 0;  // a save (the last one, or an estimate before the first)
  // Whether a run `elapsed_s` into `budget_s` stops after the step it just took instead of going
  // on: going on costs that step's periodic evaluation and save when they are due (`eval_due`,
  // `save_due`), the next step, and the final evaluation and save.
  bool stop_now(double elapsed_s, double budget_s, bool eval_due, bool save_due) const {
    const double due = (eval_due ? eval_s : 0) + (save_due ? save_s : 0);
    return elapsed_s + due + step_s + eval_s + save_s > budget_s;
  }
};

// Checks the options that do not depend on the model; errors name the flag.
absl::Status validate_options(const TrainOptions& opts);
// Options as JSON (trainer_state.json's "options") and back.
std::string options_to_json(const TrainOptions& opts);
absl::StatusOr<TrainOptions> options_from_json(const std::string& json_text);

// The model `cemlm train` builds when given no --config or --init (see docs/TRAINING.md).
ModelConfig default_model_config();

// The options a run in `out_dir` was started with (its trainer_state.json), for --resume. When
// an interrupted save left no `out_dir` but its checkpoint moved aside (see SavesLeft), those of
// that checkpoint, which the resumed run puts back.
// `step`, when given, gets the steps the run has done (its state's "step"; 0 where the file holds
// no valid one: the run checks it when it resumes).
absl::StatusOr<TrainOptions> load_run_options(const std::string& out_dir, int64_t* step = nullptr);

// trainer_state.json is a few KB; a larger one is damaged (not read whole into memory).
inline constexpr uint64_t kMaxTrainerStateBytes = uint64_t(64) << 20;

// What interrupted saves left beside the checkpoint directory `out`: a process killed while
// saving leaves its "<out>.tmp-<pid>-<n>" (`unfinished`). On a file system that cannot swap two
// directories in one rename (NFS), a save moves the previous checkpoint aside to
// "<out>.tmp-<pid>-<n>.old" before renaming the new one in (`aside`): killed between the two
// renames, it leaves no `out`, and the previous checkpoint there.
struct SavesLeft {
  std::vector<std::filesystem::path> unfinished, aside;
  // The newest of `aside` (several: each run restores the one before it); empty when none.
  std::filesystem::path latest_aside() const;
};
SavesLeft saves_left_beside(const std::filesystem::path& out);

struct TrainCallbacks {
  std::function<void(const std::string&)> on_info;  // setup messages
  std::function<bool(const StepMetrics&)> on_step;  // false: stop cleanly (and save)
  // Asked while the run sets up (once the tokenizer is ready, before each data file is encoded)
  // and once more right before the first step (`last` true): true ends the run there, with
  // nothing trained or saved. A stop asked for after the last check is on_step's.
  std::function<bool(bool last)> stop_before_training;
  // Asked after an evaluation or a save at `step` (`saved`: a save just ended): true stops the
  // run there, saving it first if it was not, instead of training one more step (and evaluating
  // again) before on_step could stop it.
  std::function<bool(int64_t step, bool saved)> stop_after;
  std::function<void(const EvalMetrics&)> on_eval;
  std::function<void(int64_t step, const std::string& dir)> on_save;
};

struct TrainSummary {
  int64_t step = 0;       // updates done when the run ended
  bool finished = false;  // reached opts.steps (else stopped by on_step or --max-minutes)
  EvalMetrics last_eval;
  int64_t parameters = 0;
};

// Trains per `opts`, saving to opts.out_dir every save_every steps and at the end. With
// opts.resume, continues the run saved there: given the same options, the losses continue
// exactly as if the run had never stopped. Errors name the flag or file at fault.
absl::StatusOr<TrainSummary> train(const TrainOptions& opts, const TrainCallbacks& callbacks = {});

}  // namespace cemlm
