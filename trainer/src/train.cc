// The training loop: model, tokenizer and data setup, the step (accumulated forward/backward,
// clipping, AdamW), evaluation at several T, and checkpoints that carry everything a bit-exact
// resume needs (optimizer moments, step, both RNG states, the metrics log).
#include "cemlm/trainer/train.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/corpus.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/float32.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/strict_json.h"
#include "cemlm/engine/tokenizer.h"
#include "cemlm/engine/utf8.h"
#include "cemlm/trainer/backprop.h"
#include "cemlm/trainer/data.h"
#include "nlohmann/json.hpp"

namespace cemlm {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

// Independent RNG streams, so that the data order does not depend on how T is drawn.
constexpr uint64_t kDataStream = 0x5851f42d4c957f2dULL;
constexpr uint64_t kRecursionStream = 0x14057b7ef767814fULL;

absl::Status with_prefix(const std::string& prefix, const absl::Status& st) {
  return st.ok() ? st : absl::Status(st.code(), absl::StrCat(prefix, st.message()));
}

absl::Status write_text(const std::string& path, const std::string& text) {
  return write_file_atomic(path, [&](std::FILE* f) {
    return std::fwrite(text.data(), 1, text.size(), f) == text.size()
               ? absl::OkStatus()
               : absl::UnavailableError(absl::StrCat("cannot write '", path, "'"));
  });
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The largest gradient norm AdamW takes: the square of each element must fit its float second
// moment. Past it (--clip 0 and weights near fp32's range) moments became inf, which froze their
// weights without a word and saved an optimizer state that --resume refuses.
const double kMaxUpdateNorm = std::sqrt(double(std::numeric_limits<float>::max()));

// The norm of the gradient the optimizer gets: clipped to --clip when that is on.
double update_norm(const StepMetrics& m, double clip) {
  return clip > 0 ? std::min(m.grad_norm, clip) : m.grad_norm;  // NaN stays NaN
}

// A step is applied only when its loss and gradient norm are finite, and its update's norm at
// most kMaxUpdateNorm: a NaN or inf update would reach every weight. The loss can be finite while
// the gradient overflows (weights near fp32's range), so both are checked. Else the run stops,
// before the update and any save.
bool finite_step(const StepMetrics& m, double clip) {
  return std::isfinite(m.loss) && std::isfinite(m.grad_norm) &&
         update_norm(m, clip) <= kMaxUpdateNorm;
}

// What a run that ends in error leaves: said only where a checkpoint is there to keep.
const char* kept(bool saved) {
  return saved ? " (the last checkpoint is kept)" : " (the run saved no checkpoint)";
}

// Weights whose validation loss is not finite are not saved: a healthy model's log-softmax is
// finite whatever its logits. A damaged optimizer state that passes --resume's checks (a finite
// but absurd first moment) made one update that ruined the model, and the run then wrote it over
// the good checkpoint and exited 0.
absl::Status finite_eval(const EvalMetrics& e, bool saved) {
  for (const auto& [T, loss] : e.loss)
    if (!std::isfinite(loss))
      return absl::InternalError(absl::StrCat(
          "training diverged: the validation loss at step ", e.step, " is not finite at T = ", T,
          "; nothing saved", kept(saved), ": resume from a good copy, or lower --lr or --clip"));
  return absl::OkStatus();
}

absl::Status diverged(const StepMetrics& m, double clip, bool saved) {
  if (std::isfinite(m.loss) && std::isfinite(m.grad_norm))
    return absl::InternalError(absl::StrCat(
        "training diverged: the gradient norm at step ", m.step, " is ", update_norm(m, clip),
        ", past the ", kMaxUpdateNorm, " whose squares AdamW's float moments hold (the loss is ",
        m.loss, "); clip it with --clip", kept(saved)));
  const std::string what = std::isfinite(m.loss)
                               ? absl::StrCat("the gradient norm at step ", m.step,
                                              " is not finite (the loss is ", m.loss, ")")
                               : absl::StrCat("the loss at step ", m.step, " is not finite");
  return absl::InternalError(
      absl::StrCat("training diverged: ", what, "; lower --lr or --clip", kept(saved)));
}

// A training step that does not fit in memory: found before training (`step` < 0; `needed`, the
// bytes a step takes at least), or at a step (forward_backward refuses it before its pages are
// taken), where `saved` says whether a checkpoint is kept.
absl::Status out_of_memory(const TrainOptions& o, int64_t step, bool saved, int64_t needed = 0) {
  const int64_t left = available_memory_bytes();
  return absl::ResourceExhaustedError(absl::StrCat(
      "out of memory", step >= 0 ? absl::StrCat(" at training step ", step + 1) : "",
      ": the activations of --batch-size ", o.batch_size, " × --seq-len ", o.seq_len,
      " at T up to ", o.train_recursion.max,
      needed > 0 ? absl::StrCat(" take at least ", needed >> 20, " MiB and") : "",
      " do not fit in the memory left (",
      left >= 0 ? absl::StrCat(left >> 20, " MiB") : std::string("unknown"),
      " on this machine or under its cgroup's limit; less under a ulimit -v); lower --batch-size "
      "(a larger --accum keeps the tokens per step) or --seq-len",
      step >= 0 ? kept(saved) : ""));
}

// The options of `now` that differ from `saved` (a resumed run's), as "--flag saved → now", in
// the order of their names. The time budget is left out: it changes no result. The thread count
// is named: OpenBLAS splits a large product over the threads, which can change its last bits.
std::string changed_options(const TrainOptions& saved, const TrainOptions& now) {
  const json before = json::parse(options_to_json(saved)),
             after = json::parse(options_to_json(now));
  auto text = [](const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); };
  std::vector<std::string> changed;
  for (const auto& [key, value] : after.items()) {
    if (key == "max_minutes" || key == "out") continue;
    if (before.contains(key) && before[key] == value) continue;
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    changed.push_back(absl::StrCat(
        "--", flag, " ", before.contains(key) ? text(before[key]) : "(none)", " → ", text(value)));
  }
  return absl::StrJoin(changed, ", ");
}

class Trainer {
 public:
  Trainer(const TrainOptions& o, const TrainCallbacks& cb)
      : o_(o), cb_(cb), data_rng_(o.seed ^ kDataStream), t_rng_(o.seed ^ kRecursionStream) {}
  ~Trainer() {
    if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock on --out
  }
  absl::StatusOr<TrainSummary> run();

 private:
  void info(const std::string& s) const {
    if (cb_.on_info) cb_.on_info(s);
  }
  std::string in_out(const char* file) const { return (out_ / file).string(); }
  // --out without a trailing separator, so that siblings ("<out>.cache") are not inside it.
  fs::path out_path() const { return out_; }
  fs::path cache_path() const {
    return o_.cache_dir.empty() ? fs::path(out_path().string() + ".cache") : fs::path(o_.cache_dir);
  }
  std::string in_cache(const char* file) const { return (cache_path() / file).string(); }
  // Whether the caller asks to stop before the first step (`last`: the check right before it).
  bool stop_asked(bool last) const {
    return cb_.stop_before_training && cb_.stop_before_training(last);
  }
  absl::Status check_paths_are_utf8() const;
  absl::Status load_model();
  absl::Status check_out_and_cache_paths() const;
  absl::Status lock_out();
  // A new run's --out must not hold a checkpoint (--resume continues it, --init starts from it).
  absl::Status check_out_is_new() const;
  absl::Status remove_stale_saves() const;
  void remove_dead_cache_temps() const;
  absl::StatusOr<CorpusFiles> list_data() const;
  absl::Status set_up(const CorpusFiles& corpus);
  absl::Status prepare_tokenizer(const CorpusFiles& corpus);
  absl::Status prepare_params();
  absl::Status check_against_model();
  absl::Status load_data(const CorpusFiles& corpus);
  absl::Status restore();
  void note_split_change();  // after load_data, of a resumed run
  int draw_T();
  // One update, left out (step_ unchanged) when finite_step(m, clip) is false.
  StepMetrics step();
  // Mean validation loss at each evaluation depth, over the first `max_rows` validation windows
  // (all of them by default).
  EvalMetrics evaluate(int max_rows = std::numeric_limits<int>::max());
  // An evaluation's time before one was measured: its forward passes (over eval windows, at each
  // evaluated T) against a step's forward and backward (~3 forwards over batch × accum windows at
  // the mean training T).
  double estimated_eval_s(double step_s) const {
    double eval_T = 0;
    for (int T : eval_T_) eval_T += T;
    const double rows = double(eval_ids_.size()) / double(o_.seq_len);
    const double train_T =
        cfg_.has_cem() ? 0.5 * (o_.train_recursion.min + o_.train_recursion.max) : 1;
    return step_s * rows * eval_T / (3.0 * o_.batch_size * o_.accum * train_T);
  }
  absl::Status save();
  absl::Status write_extra(const std::string& dir) const;

  TrainOptions o_;
  fs::path out_;  // --out, its links followed at the start of run(): where this run saves
  TrainCallbacks cb_;
  ModelConfig cfg_;
  bool fresh_ = true;  // a new model (not --init, not --resume)
  int lock_fd_ = -1;   // the open lock file of --out, once locked
  ParamStore params_, grads_;
  Weights w_, gw_;
  std::unique_ptr<AdamW> opt_;
  LrSchedule sched_;
  Rng data_rng_, t_rng_;
  std::string tokenizer_path_;
  // The tokenizer's bytes, read once: every save writes these, whatever happens to the file
  // later (a shared --cache's tokenizer.model is replaced when another run trains its own).
  std::string tokenizer_bytes_;
  std::unique_ptr<Tokenizer> tokenizer_;
  TokenData data_;
  uint64_t val_hash_ = 0;  // of data_.val's ids, saved so that a resume sees its split change
  // A resumed run's saved split: its rule, and the hash of its validation ids where saved.
  std::string saved_split_;
  std::optional<uint64_t> saved_val_hash_;
  std::vector<int> eval_ids_, eval_T_, batch_ids_;
  MetricsLog log_;
  int64_t step_ = 0, tokens_ = 0;
  double prior_elapsed_s_ = 0;  // before this invocation (resume)
  // The products' threads, resolved (--threads 0: the CPUs or OMP_NUM_THREADS): saved, since a
  // resume on another count splits products otherwise and loses bit-exactness.
  int compute_threads_ = 0;
  Clock::time_point start_;
  // When run() began: --max-minutes is the budget of the whole run, its set-up included.
  const Clock::time_point run_start_ = Clock::now();
  double train_s_ = 0;  // this invocation, inside steps
  int64_t steps_run_ = 0;
};

// Saved with the run's options, so that --resume reads the same files from any directory (a
// relative --cache resumed elsewhere silently encoded the data again into a new cache there).
// Without a trailing separator: "--data data/" is the run's "--data data" (a resume said the
// options differed).
void absolute_paths(TrainOptions& o) {
  auto absolute = [](std::string& p) {
    std::error_code ec;
    fs::path abs = fs::absolute(p, ec).lexically_normal();
    if (!abs.has_filename() && abs.has_relative_path()) abs = abs.parent_path();
    if (!p.empty() && !ec) p = abs.string();
  };
  for (std::string& p : o.data) absolute(p);
  for (std::string* p : {&o.cache_dir, &o.config_path, &o.init_dir, &o.tokenizer_path})
    absolute(*p);
}

// The run's options, paths included, are saved as JSON text, which holds UTF-8 only; a Linux path
// may hold any bytes, and such a one made the first save fail (after every step had run).
absl::Status Trainer::check_paths_are_utf8() const {
  std::vector<std::pair<const char*, const std::string*>> paths = {
      {"out", &o_.out_dir},
      {"cache", &o_.cache_dir},
      {"config", &o_.config_path},
      {"init", &o_.init_dir},
      {"tokenizer", &o_.tokenizer_path}};
  for (const std::string& p : o_.data) paths.emplace_back("data", &p);
  for (const auto& [flag, path] : paths)
    if (const size_t ok = utf8_valid_prefix(*path); ok != path->size())
      return absl::InvalidArgumentError(absl::StrCat(
          "--", flag, " '", absl::CHexEscape(*path), "' is not valid UTF-8 (bad byte at offset ",
          ok,
          "): the run saves its paths in trainer_state.json, which holds UTF-8 only; rename it "
          "or use another path"));
  return absl::OkStatus();
}

absl::Status Trainer::load_model() {
  std::error_code ec;
  if (o_.resume || !o_.init_dir.empty()) {
    const std::string& dir = o_.resume ? o_.out_dir : o_.init_dir;
    auto ck = load_checkpoint(dir);
    if (!ck.ok()) return with_prefix(o_.resume ? "--resume: " : "--init: ", ck.status());
    cfg_ = ck->config;
    params_ = std::move(ck->params);
    tokenizer_path_ = ck->tokenizer_path;
    fresh_ = false;
  } else if (!o_.config_path.empty()) {
    auto c = load_config(o_.config_path);
    if (!c.ok()) return with_prefix("--config: ", c.status());
    cfg_ = *c;
  } else {
    cfg_ = default_model_config();
  }
  CEMLM_RETURN_IF_ERROR(check_out_is_new());
  // Before any training, not at the first save (a resumed run's --out included).
  CEMLM_RETURN_IF_ERROR(with_prefix("--out: ", check_checkpoint_target(o_.out_dir)));
  CEMLM_RETURN_IF_ERROR(check_out_and_cache_paths());
  if (!fresh_ && o_.vocab_size > 0 && o_.vocab_size != cfg_.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat(
        "--vocab-size ", o_.vocab_size, " applies to a new model; the checkpoint of ",
        o_.resume ? "--resume" : "--init", " has vocab_size ", cfg_.vocab_size,
        ", which it keeps: leave --vocab-size out"));
  if (fresh_ && o_.vocab_size > 0) {
    cfg_.vocab_size = o_.vocab_size;
    auto c = parse_config(config_to_json(cfg_));  // re-derives what depends on the vocabulary
    if (!c.ok()) return with_prefix("--vocab-size: ", c.status());
    cfg_ = *c;
  }
  return absl::OkStatus();
}

// A save replaces --out whole (a checkpoint directory holds the checkpoint alone), so a --cache
// there would be refused at the first save, after the training, or lost with it. In --init's
// checkpoint, the cache's files made it a directory no run could save or resume into.
absl::Status Trainer::check_out_and_cache_paths() const {
  std::error_code ec;
  auto resolved = [&](const fs::path& p) { return fs::weakly_canonical(fs::absolute(p), ec); };
  auto inside = [](const fs::path& path, const fs::path& dir) {
    const fs::path rel = path.lexically_relative(dir);
    return rel.empty() || *rel.begin() == ".." ? std::optional<fs::path>() : rel;
  };
  const fs::path cache = resolved(cache_path());
  if (ec) return absl::OkStatus();  // what cannot be resolved is reported where it is used
  // Before the tokenizer trains (it was refused writing there, after that): a directory, made
  // when missing.
  if (fs::exists(cache, ec) && !fs::is_directory(cache, ec))
    return absl::InvalidArgumentError(absl::StrCat(
        o_.cache_dir.empty() ? "the default --cache '" : "--cache '", cache_path().string(),
        "' is not a directory: the tokenizer and the encoded data are written into it; name a "
        "directory (made when missing)"));
  // --out inside --init's checkpoint would leave a directory there, and its lock file: a
  // checkpoint no run could save or resume into. (--out equal to --init holds a checkpoint:
  // refused before as such.)
  if (!o_.init_dir.empty()) {
    const fs::path init = resolved(o_.init_dir), out = resolved(out_path());
    if (const auto rel = ec ? std::nullopt : inside(out, init); rel && *rel != ".")
      return absl::InvalidArgumentError(absl::StrCat(
          "--out '", o_.out_dir, "' is inside --init ('", o_.init_dir,
          "'), a checkpoint, which holds its own files alone: choose an --out outside it"));
  }
  const std::pair<const char*, std::string> checkpoints[] = {{"--out", o_.out_dir},
                                                             {"--init", o_.init_dir}};
  for (const auto& [flag, dir] : checkpoints) {
    if (dir.empty()) continue;
    const fs::path checkpoint = resolved(dir);
    if (ec) continue;
    const auto rel = inside(cache, checkpoint);
    if (!rel) continue;
    const bool given = !o_.cache_dir.empty();  // left out, it is '<out>.cache'
    return absl::InvalidArgumentError(absl::StrCat(
        given ? "--cache '" : "the default --cache '", given ? o_.cache_dir : cache_path().string(),
        "' is ", *rel == "." ? absl::StrCat(flag, " itself") : absl::StrCat("inside ", flag), " ('",
        dir, "'), ",
        std::string_view(flag) == "--out" ? "which every save replaces with the checkpoint alone"
                                          : "a checkpoint, which holds its own files alone",
        given ? ": choose a --cache outside it, or leave it out (the default is '<out>.cache' "
                "beside --out)"
              : ": give a --cache outside it, or another --out (the default --cache is "
                "'<out>.cache')"));
  }
  // Nor any other checkpoint, or a folder inside one: the cache's tokenizer.model replaced its
  // tokenizer (its weights then read other ids), and its files left a directory no run could
  // save or resume into. A cemlm checkpoint's config.json, not any (a Hugging Face model folder
  // holds a config.json and a model.safetensors too).
  for (fs::path dir = cache; !dir.empty(); dir = dir.parent_path()) {
    if (fs::exists(dir / kWeightsFile, ec) && load_checkpoint_config(dir.string()).ok())
      return absl::InvalidArgumentError(absl::StrCat(
          o_.cache_dir.empty() ? "the default --cache '" : "--cache '", cache_path().string(),
          "' is ", dir == cache ? "" : absl::StrCat("inside '", dir.string(), "', "),
          "a checkpoint directory, which holds its own files alone (its tokenizer.model would be "
          "replaced, and its weights would read other ids): choose a --cache outside any "
          "checkpoint"));
    if (dir == dir.root_path()) break;
  }
  return absl::OkStatus();
}

// One run at a time writes --out: a second would save over the first's checkpoint, and its
// remove_stale_saves would delete the save the first has in progress. The lock is an flock on
// ".<out>.lock" beside --out (a checkpoint directory holds only the checkpoint; hidden, so that
// --data naming the parent directory does not read it), held until the run ends, also when the
// process is killed. The file stays: a run that unlinked it could leave two holders (one of the
// unlinked file, one of a new file at the same path).
absl::Status Trainer::check_out_is_new() const {
  std::error_code ec;
  if (!o_.resume && !o_.init_dir.empty() && fs::equivalent(o_.init_dir, out_path(), ec))
    return absl::AlreadyExistsError(absl::StrCat(
        "--init and --out name the same checkpoint '", o_.out_dir,
        "': a run starting from its weights saves a new checkpoint; choose another --out (or "
        "pass --resume without --init to continue its own run)"));
  if (!o_.resume && fs::exists(in_out(kConfigFile), ec))
    return absl::AlreadyExistsError(
        absl::StrCat("--out '", o_.out_dir,
                     "' already holds a checkpoint: pass --resume to continue its run, "
                     "--init to start from its weights, or choose another --out"));
  return absl::OkStatus();
}

absl::Status Trainer::lock_out() {
  CEMLM_RETURN_IF_ERROR(with_prefix("--out: ", create_checkpoint_parent(o_.out_dir)));
  const fs::path lock = lock_path_of(out_path());  // out_, resolved once: where the saves go
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0)
    return absl::UnavailableError(absl::StrCat("--out: cannot open the lock file '", lock.string(),
                                               "': ", std::strerror(errno)));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK)
      return absl::UnavailableError(absl::StrCat("--out: cannot lock '", lock.string(),
                                                 "': ", std::strerror(errno),
                                                 "; choose an --out on a local file system"));
    char pid[32] = {};
    const ssize_t n = ::pread(lock_fd_, pid, sizeof(pid) - 1, 0);
    const std::string holder =
        n > 0 ? absl::StrCat(" (pid ", std::string(pid, size_t(n)), ")") : "";
    return absl::FailedPreconditionError(absl::StrCat(
        "--out '", o_.out_dir, "' is in use: another cemlm train run", holder, " holds its lock '",
        lock.string(), "'; wait for that run to end, or choose another --out"));
  }
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(lock_fd_, 0) != 0 ||
      ::pwrite(lock_fd_, pid.data(), pid.size(), 0) != ssize_t(pid.size()))
    return absl::UnavailableError(absl::StrCat("--out: cannot write the lock file '", lock.string(),
                                               "': ", std::strerror(errno)));
  return absl::OkStatus();
}

// Saves left by interrupted runs (saves_left_beside): one run owns --out, so they are stale, but
// for a checkpoint moved aside while no --out exists, which --resume puts back (a new run is
// refused rather than have it deleted).
absl::Status Trainer::remove_stale_saves() const {
  const fs::path out = out_path();
  SavesLeft left = saves_left_beside(out);
  std::error_code ec;
  if (!left.aside.empty() && !fs::exists(out, ec)) {
    const fs::path last = left.latest_aside();
    if (!o_.resume)
      return absl::FailedPreconditionError(absl::StrCat(
          "--out '", o_.out_dir, "': its checkpoint was moved aside to '", last.string(),
          "' by a save that was interrupted; pass --resume to put it back and continue that run, "
          "or choose another --out"));
    info(absl::StrCat("restoring ", out.string(), " from ", last.string(),
                      " (moved aside by an interrupted save)"));
    fs::rename(last, out, ec);
    if (ec)
      return absl::UnavailableError(absl::StrCat("--resume: cannot rename '", last.string(),
                                                 "' back to '", out.string(), "': ", ec.message()));
    left.aside.erase(std::find(left.aside.begin(), left.aside.end(), last));
  }
  for (const auto* list : {&left.unfinished, &left.aside})
    for (const fs::path& p : *list) {
      info(absl::StrCat("removing ", p.string(), " (left by an interrupted save)"));
      fs::remove_all(p, ec);
    }
  return absl::OkStatus();
}

// The model's own tokenizer, else --tokenizer, else one trained on the data (and cached).
absl::Status Trainer::prepare_tokenizer(const CorpusFiles& corpus) {
  if (o_.resume && tokenizer_path_.empty())
    return absl::FailedPreconditionError(absl::StrCat(
        "--resume: '", o_.out_dir, "' has no ", kTokenizerFile,
        " (every save writes the one its data was encoded with); restore that file, or start a "
        "new run from these weights with --init ",
        o_.out_dir, " --tokenizer FILE"));
  if (!o_.resume && !tokenizer_path_.empty() && !o_.tokenizer_path.empty())
    return absl::InvalidArgumentError(absl::StrCat(
        "--tokenizer: the checkpoint of --init has its own ", kTokenizerFile,
        ", which its weights were trained with; leave --tokenizer out (it is for a model "
        "without one)"));
  // Named in errors: where the tokenizer came from.
  std::string source = o_.resume ? "--resume" : "--init";
  if (tokenizer_path_.empty() && !o_.tokenizer_path.empty()) {
    tokenizer_path_ = o_.tokenizer_path;
    source = "--tokenizer";
  }
  if (tokenizer_path_.empty()) {
    tokenizer_path_ = in_cache(kTokenizerFile);
    source = "--cache";
    // The key names the data and vocabulary it was trained for, and the model file's hash: a save
    // interrupted between the two files, or another run sharing --cache that replaced the model,
    // leaves a key that matches no model, and the tokenizer is trained again.
    // A tokenizer an --init run trained with fewer pieces than its vocabulary (the most its
    // text makes) is keyed "<data>-<vocabulary>-<pieces>": another --init run of that vocabulary
    // reuses it, a new model of that vocabulary does not (it refuses such a text).
    const std::string key = absl::StrCat(absl::Hex(corpus.key), "-", cfg_.vocab_size);
    std::string cached, error;
    const absl::StatusOr<uint64_t> model_hash = hash_file(tokenizer_path_);
    std::unique_ptr<Tokenizer> loads;
    const bool matches = [&] {
      if (!read_file(in_cache(kTokenizerKeyFile), &cached, &error) || !model_hash.ok())
        return false;
      const std::string hash = absl::StrCat(" ", absl::Hex(*model_hash));
      if (!absl::EndsWith(cached, hash)) return false;
      const absl::string_view cached_key(cached.data(), cached.size() - hash.size());
      return cached_key == key || (!fresh_ && absl::StartsWith(cached_key, key + "-"));
    }();
    if (matches && (loads = Tokenizer::load(tokenizer_path_, &error))) {
      info(absl::StrCat("tokenizer: reusing ", tokenizer_path_));
    } else {
      if (!cached.empty())
        info(absl::StrCat("tokenizer: ", in_cache(kTokenizerKeyFile),
                          matches
                              ? absl::StrCat(" matches, but its model does not load (", error, ")")
                              : " is for other data, another vocabulary or another model file "
                                "(a run sharing --cache, an older cemlm, a damaged or replaced "
                                "file)",
                          ": training it again"));
      info(absl::StrCat("tokenizer: training ", cfg_.vocab_size, " pieces on ", corpus.paths.size(),
                        " files"));
      std::error_code ec;
      fs::remove(in_cache(kTokenizerKeyFile), ec);  // no key for a model being replaced
      // The data's own files: collecting --data again would take in what list_corpus leaves out
      // (this run's --cache and --out, when --data holds them).
      TokenizerTrainOptions t{corpus.paths, cfg_.vocab_size, tokenizer_path_};
      t.inputs_flag = "--data";
      t.out_flag = "--cache";  // the tokenizer is written there, not into --out
      t.threads = compute_threads_;  // --threads (it trained on every CPU whatever was given)
      t.vocab_flag = !fresh_                  ? "the --init model's vocab_size"
                     : o_.vocab_size > 0      ? "--vocab-size"
                     : o_.config_path.empty() ? "--vocab-size (the default model's)"
                                              : "--config's vocab_size";
      TokenizerTrainStats stats;
      error.clear();
      bool trained = train_tokenizer(t, &error, &stats);
      if (!trained && !fresh_ && stats.max_vocab_size > 0) {
        // The weights fix the vocabulary, but a tokenizer may use fewer of its ids than it has.
        info(absl::StrCat("tokenizer: this text makes at most ", stats.max_vocab_size,
                          " pieces, fewer than the --init model's vocab_size ", cfg_.vocab_size,
                          ": training ", stats.max_vocab_size, " (ids ", stats.max_vocab_size,
                          " to ", cfg_.vocab_size - 1, " stay unused)"));
        t.vocab_size = stats.max_vocab_size;
        stats = {};
        error.clear();
        trained = train_tokenizer(t, &error, &stats);
      }
      if (!trained) {
        if (!fresh_ && stats.min_vocab_size > 0)  // --init: its vocabulary cannot be raised
          return absl::InvalidArgumentError(absl::StrCat(
              "training the tokenizer on --data: this text needs at least ", stats.min_vocab_size,
              " pieces (its characters, the special and the byte pieces), but the model of "
              "--init has vocab_size ",
              cfg_.vocab_size, ", which its weights fix: pass --tokenizer FILE with at most ",
              cfg_.vocab_size,
              " pieces (trained on text with fewer distinct characters), or start a new model "
              "(--config) with --vocab-size ",
              stats.min_vocab_size, " or more"));
        return absl::InvalidArgumentError(
            absl::StrCat("training the tokenizer on --data: ", error));
      }
      info(absl::StrCat("tokenizer: trained on ", stats.files, " files (",
                        absl::SixDigits(double(stats.bytes) / 1e6), " MB)"));
      // The hash of the bytes trained, not of the file now: a run sharing --cache may have
      // replaced it since, and the key must not vouch for that one. The key names the pieces
      // trained: fewer than the --init model's vocabulary, it is no tokenizer for a new model of
      // that vocabulary (such a run reused it, where a fresh --cache refused it).
      CEMLM_RETURN_IF_ERROR(write_text(
          in_cache(kTokenizerKeyFile),
          absl::StrCat(key, t.vocab_size == cfg_.vocab_size ? "" : absl::StrCat("-", t.vocab_size),
                       " ", absl::Hex(hash_bytes(stats.model)))));
    }
  }
  std::string error, again;
  if (!read_file(tokenizer_path_, &tokenizer_bytes_, &error))
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", error));
  tokenizer_ = Tokenizer::load(tokenizer_path_, &error);
  if (!tokenizer_) return absl::InvalidArgumentError(absl::StrCat(source, ": ", error));
  // The bytes kept must be those loaded: a run sharing --cache may replace the file meanwhile.
  if (!read_file(tokenizer_path_, &again, &error) || again != tokenizer_bytes_)
    return absl::UnavailableError(absl::StrCat(
        "the tokenizer '", tokenizer_path_,
        "' changed while it was being loaded (another run sharing --cache?); run again"));
  const auto& tokenizer = tokenizer_;
  if (tokenizer->vocab_size() > cfg_.vocab_size)
    return absl::InvalidArgumentError(absl::StrCat(
        "the tokenizer '", tokenizer_path_, "' has ", tokenizer->vocab_size(),
        " pieces but the model's vocab_size is ", cfg_.vocab_size,
        fresh_ ? ": raise --vocab-size (or the config's vocab_size) or use a smaller tokenizer"
               : absl::StrCat(", which its checkpoint's weights fix: use a tokenizer with at most ",
                              cfg_.vocab_size, " pieces (cemlm tokenizer train --vocab-size ",
                              cfg_.vocab_size, ")")));
  return absl::OkStatus();
}

absl::Status Trainer::prepare_params() {
  if (fresh_) {
    params_ = ParamStore(cfg_);
    params_.init_random(o_.seed);
  }
  grads_ = ParamStore(cfg_);
  w_ = bind_weights(cfg_, params_);
  gw_ = bind_weights(cfg_, grads_);
  opt_ = std::make_unique<AdamW>(params_.specs(), o_.adamw);
  sched_ = LrSchedule{o_.lr, o_.min_lr, o_.warmup, o_.steps};
  return absl::OkStatus();
}

absl::Status Trainer::check_against_model() {
  if (o_.train_recursion.max > cfg_.recursion_max)
    return absl::InvalidArgumentError(
        absl::StrCat("--train-recursion ", recursion_range_text(o_.train_recursion),
                     " goes above the model's recursion.max ", cfg_.recursion_max,
                     ": lower it or raise recursion.max in the config"));
  if (o_.seq_len > cfg_.max_seq_len)
    return absl::InvalidArgumentError(absl::StrCat(
        "--seq-len ", o_.seq_len, " exceeds the model's max_seq_len ", cfg_.max_seq_len));
  // A batch too large for the memory left is refused before the tokenizer and the data: its
  // step's activations grew until the kernel's out-of-memory killer ended the run minutes later.
  const int64_t step_bytes =
      std::min<int64_t>(INT64_MAX / 2, forward_backward_min_bytes(cfg_, o_.batch_size, o_.seq_len,
                                                                  o_.train_recursion.max)) +
      int64_t(o_.batch_size) * o_.seq_len * int64_t(sizeof(int32_t));
  if (!memory_left_for(step_bytes)) return out_of_memory(o_, -1, false, step_bytes);
  eval_T_.clear();
  for (int T : o_.eval_recursion)
    if (T <= cfg_.recursion_max) eval_T_.push_back(T);
  if (eval_T_.empty())
    return absl::InvalidArgumentError(absl::StrCat(
        "--eval-recursion: every depth is above the model's recursion.max ", cfg_.recursion_max));
  if (eval_T_.size() < o_.eval_recursion.size())
    info(absl::StrCat("evaluation: depths above recursion.max ", cfg_.recursion_max, " skipped"));
  if (!cfg_.has_cem()) eval_T_ = {1};  // no CEM sub-layer: T changes nothing
  return absl::OkStatus();
}

absl::Status Trainer::load_data(const CorpusFiles& corpus) {
  const auto& tokenizer = tokenizer_;  // loaded with tokenizer_bytes_, which the saves write
  const uint64_t tok_hash = hash_bytes(tokenizer_bytes_);
  const int bos = resolve_bos_id(cfg_.bos_id, tokenizer.get());
  const int eos = resolve_eos_id(cfg_.eos_id, tokenizer.get());
  // A config's bos_id or eos_id that is a piece text encodes to (a byte, a word) marks the
  // documents with a token their text holds as well: said, since nothing else would.
  for (const auto& [field, id, own] : {std::tuple{"bos_id", cfg_.bos_id, tokenizer->bos_id()},
                                       std::tuple{"eos_id", cfg_.eos_id, tokenizer->eos_id()}})
    if (const int one[] = {id}; id >= 0 && id != own && id < tokenizer->vocab_size() &&
                                id != tokenizer->unk_id() && !tokenizer->decode(one).empty())
      info(absl::StrCat("note: the config's ", field, " ", id, " is the tokenizer's piece '",
                        absl::CHexEscape(tokenizer->id_to_piece(id)),
                        "', which text encodes to as well (",
                        own >= 0 ? absl::StrCat("the tokenizer's own is ", own)
                                 : std::string("the tokenizer has none of its own"),
                        "): the documents' marks cannot be told from that text; leave ", field,
                        " out of the config to use the tokenizer's"));
  CEMLM_ASSIGN_OR_RETURN(
      data_, load_token_data(corpus, *tokenizer, tok_hash, bos, eos, in_cache(kTokenCacheFile),
                             o_.val_fraction, [this] { return stop_asked(false); }));
  val_hash_ = hash_bytes(
      {reinterpret_cast<const char*>(data_.val.data()), data_.val.size() * sizeof(int32_t)});
  info(absl::StrCat("data: ", data_.files, " files, ", data_.train.size(), " training and ",
                    data_.val.size(), " validation tokens", data_.from_cache ? " (cached)" : ""));
  if (data_.train.size() < size_t(o_.seq_len))
    return absl::InvalidArgumentError(
        absl::StrCat("--data holds ", data_.train.size(), " training tokens, fewer than --seq-len ",
                     o_.seq_len, ": give more text (or a shorter --seq-len)"));
  eval_ids_ = eval_windows(data_.val, o_.seq_len, o_.eval_windows);
  if (eval_ids_.empty())
    return absl::InvalidArgumentError(absl::StrCat(
        "--data: the validation split has ", data_.val.size(), " tokens, fewer than --seq-len ",
        o_.seq_len, ": give more text, raise --val-fraction or shorten --seq-len"));
  return absl::OkStatus();
}

absl::Status Trainer::restore() {
  CEMLM_RETURN_IF_ERROR(with_prefix("--resume: ", opt_->load(in_out(kOptimizerFile))));
  std::string text, error;
  if (!read_file(in_out(kTrainerStateFile), &text, &error, kMaxTrainerStateBytes))
    return absl::NotFoundError("--resume: " + error);
  // Strict, as config.json is read: a syntax error says where, and a key given twice is refused.
  absl::StatusOr<json> parsed = parse_json_strict(text);
  if (!parsed.ok())
    return absl::InvalidArgumentError(absl::StrCat("--resume: ", in_out(kTrainerStateFile), ": ",
                                                   parsed.status().message(),
                                                   " (the file is damaged)"));
  const json& j = *parsed;
  std::string options_text;
  int saved_threads = 0;  // 0: not saved
  std::optional<uint64_t> saved_tokenizer_hash;  // not in the states of cemlm before it was saved
  const char* key = "";  // the one being read, named in the error
  auto get = [&](const char* k) -> const json& {
    key = k;
    return j.at(k);
  };
  auto state = [&](const char* k) {  // a generator's state: an integer in [0, 2^64)
    if (!get(k).is_number_unsigned())
      throw std::invalid_argument("must be an integer in [0, 2^64) (a generator's state)");
    return j[k].get<uint64_t>();
  };
  try {
    if (!j.is_object()) throw std::invalid_argument("not a JSON object (the file is damaged)");
    for (const auto& [k, v] : j.items())
      if (k != "format_version" && k != "step" && k != "tokens" && k != "elapsed_s" &&
          k != "data_rng" && k != "recursion_rng" && k != "split" && k != "options" &&
          k != "compute_threads" && k != "validation_hash" && k != "tokenizer_hash") {
        key = "";
        throw std::invalid_argument(absl::StrCat("unknown key \"", absl::CHexEscape(k),
                                                 "\" (the file is damaged, or "
                                                 "from another cemlm version)"));
      }
    auto count = [&](const char* k) {
      const json& v = get(k);
      if (!integer_fits<int64_t>(v))
        throw std::invalid_argument(
            absl::StrCat("must be an integer in [0, 2^63) (got ", v.dump(), ")"));
      const int64_t n = v.get<int64_t>();
      if (n < 0) throw std::invalid_argument("must be at least 0");
      return n;
    };
    if (const json& v = get("format_version"); v != 1)
      throw std::invalid_argument(
          absl::StrCat("is ", v.dump(), ", not 1 (the file is from another cemlm version)"));
    step_ = count("step");
    tokens_ = count("tokens");
    const json& elapsed = get("elapsed_s");
    if (!elapsed.is_number() || elapsed.get<double>() < 0)
      throw std::invalid_argument("must be a number of seconds, at least 0");
    prior_elapsed_s_ = elapsed.get<double>();
    data_rng_.set_state(state("data_rng"));
    t_rng_.set_state(state("recursion_rng"));
    key = "split";
    if (j.contains("split") && !j["split"].is_string())
      throw std::invalid_argument(absl::StrCat("must be a string (got ", j["split"].dump(), ")"));
    saved_split_ = j.value("split", "");
    // Not in the states of cemlm before they were saved.
    for (auto [k, hash] : {std::pair{"validation_hash", &saved_val_hash_},
                           std::pair{"tokenizer_hash", &saved_tokenizer_hash}}) {
      if (!j.contains(k)) continue;
      key = k;
      if (!j[k].is_number_unsigned())
        throw std::invalid_argument(
            absl::StrCat("must be an integer in [0, 2^64) (got ", j[k].dump(), ")"));
      *hash = j[k].get<uint64_t>();
    }
    if (j.contains("options")) options_text = j["options"].dump();
    if (j.contains("compute_threads")) {  // not in the states of cemlm before it was saved
      key = "compute_threads";
      if (!integer_fits<int>(j[key]) || j[key].get<int>() < 1)
        throw std::invalid_argument(
            absl::StrCat("must be an integer of at least 1 (got ", j[key].dump(), ")"));
      saved_threads = j[key].get<int>();
    }
  } catch (const std::exception& e) {  // nlohmann reports missing keys and wrong types by throwing
    return absl::InvalidArgumentError(absl::StrCat("--resume: ", in_out(kTrainerStateFile), ": ",
                                                   *key ? absl::StrCat("\"", key, "\": ") : "",
                                                   e.what()));
  }
  // The weights read the ids of the tokenizer they were trained with: another one put in its place
  // trained on other ids without a word (and was saved as the checkpoint's).
  if (saved_tokenizer_hash && *saved_tokenizer_hash != hash_bytes(tokenizer_bytes_))
    return absl::FailedPreconditionError(absl::StrCat(
        "--resume: ", in_out(kTokenizerFile), " is not the tokenizer the run trained with (",
        kTrainerStateFile,
        " holds another one's hash), and its weights read that one's ids: put the run's "
        "tokenizer.model back"));
  if (step_ != opt_->steps())
    return absl::InvalidArgumentError(absl::StrCat(
        "--resume: ", in_out(kTrainerStateFile), " is at step ", step_, " but ", kOptimizerFile,
        " at step ", opt_->steps(), " (the checkpoint was not written by one save)"));
  if (!read_file(in_out(kMetricsFile), &text, &error))
    return absl::NotFoundError("--resume: " + error);
  CEMLM_ASSIGN_OR_RETURN(log_, MetricsLog::parse(text, in_out(kMetricsFile)));
  // Every step is logged: an emptied or cut log would lose the run's history from here on.
  if (const int64_t logged = log_.steps().empty() ? 0 : log_.steps().back().step; logged != step_)
    return absl::InvalidArgumentError(
        absl::StrCat("--resume: ", in_out(kMetricsFile), " ends at step ", logged, " but ",
                     in_out(kTrainerStateFile), " is at step ", step_,
                     " (the file is damaged, or the checkpoint was not written by one save)"));
  // Flags given again with other values apply from here on: said, since the run then no longer
  // continues as it would have (a changed --val-fraction or --data also moves the validation
  // split, so that validation losses before and after are not comparable).
  if (saved_threads > 0 && saved_threads != compute_threads_)
    info(absl::StrCat("note: resuming on ", compute_threads_, " compute threads where the run had ",
                      saved_threads,
                      ": products split their sums otherwise, so the run no longer matches an "
                      "uninterrupted one bit for bit (--threads ",
                      saved_threads, " keeps it)"));
  if (auto saved = options_from_json(options_text); saved.ok()) {
    absolute_paths(*saved);  // as saved by an older cemlm: "data/"
    if (const std::string changed = changed_options(*saved, o_); !changed.empty())
      info(absl::StrCat("note: resuming with options that differ from the run's: ", changed,
                        "; the run goes on with these, so it no longer matches an uninterrupted "
                        "run with its saved options"));
    // The schedule spans --steps: extending a finished run's --steps lifts its annealed rate
    // back up (600 → 1200 steps with the defaults: about 6×). Said with the numbers.
    const double was = LrSchedule{saved->lr, saved->min_lr, saved->warmup, saved->steps}.at(step_),
                 now = sched_.at(step_);
    if (std::abs(now - was) > 0.01 * std::max(now, was))
      info(absl::StrCat("note: at step ", step_, " the learning rate is now ", absl::SixDigits(now),
                        " (", absl::SixDigits(was),
                        " on the run's schedule), since the schedule "
                        "spans --steps ",
                        o_.steps,
                        "; to go on near the old rate, pass a lower "
                        "--lr as well"));
  }
  info(absl::StrCat("resuming at step ", step_, " of ", o_.steps));
  return absl::OkStatus();
}

void Trainer::note_split_change() {
  // The validation ids as saved tell whether they moved (other files, fraction, tokenizer or
  // split rule); a state without them, only whether the split rule did.
  if (saved_val_hash_ ? *saved_val_hash_ != val_hash_ : saved_split_ != kSplitRule)
    info(absl::StrCat(
        "note: the validation split is not the run's",
        saved_val_hash_ ? " (other --data files or contents, --val-fraction, tokenizer, or split "
                          "rule)"
        : saved_split_.empty()
            ? ": the run began with an older cemlm, whose split cut documents in two"
        : saved_split_ == "document-start,end-trains"
            ? ": the run began with an older cemlm, whose split cut a piece out of each file "
              "that is one document, also when there were enough such files to give whole"
            : ": the run began with an older cemlm, whose split gave the end of a file that is "
              "one document, its EOS, to validation",
        "; from here on it trains and evaluates on the current one (the validation curve may "
        "step, and the run is no longer bit-identical to an uninterrupted one)"));
}

int Trainer::draw_T() {
  const RecursionRange& r = o_.train_recursion;
  if (r.min == r.max) return r.min;
  return r.min + int(t_rng_.next_u64() % uint64_t(r.max - r.min + 1));
}

StepMetrics Trainer::step() {
  StepMetrics m;
  m.T = draw_T();
  std::fill(grads_.flat().begin(), grads_.flat().end(), 0.0f);
  for (int a = 0; a < o_.accum; ++a) {
    sample_windows(data_.train, o_.seq_len, o_.batch_size, data_rng_, batch_ids_.data());
    m.loss += forward_backward(cfg_, w_, gw_, batch_ids_.data(), o_.batch_size, o_.seq_len, m.T,
                               1.0f / float(o_.accum));
  }
  m.loss /= o_.accum;
  m.grad_norm = clip_grad_norm(grads_.flat(), o_.clip);
  m.lr = sched_.at(step_);
  m.step = step_ + 1;
  if (!finite_step(m, o_.clip))
    return m;  // run() stops: the weights stay those of the last good step
  opt_->step(params_.flat(), grads_.flat(), m.lr);
  ++step_;
  // Saturating: a "tokens" count near 2^63 in a damaged state file overflowed (undefined
  // behaviour), and the negative count saved made the next resume fail.
  const int64_t step_tokens = int64_t(o_.accum) * o_.batch_size * o_.seq_len;
  tokens_ = tokens_ > INT64_MAX - step_tokens ? INT64_MAX : tokens_ + step_tokens;
  m.tokens = tokens_;
  return m;
}

EvalMetrics Trainer::evaluate(int max_rows) {
  EvalMetrics e;
  e.step = step_;
  const int rows = std::min(max_rows, int(eval_ids_.size() / size_t(o_.seq_len)));
  for (int T : eval_T_) {
    double sum = 0;
    for (int r = 0; r < rows; r += o_.batch_size) {
      const int n = std::min(o_.batch_size, rows - r);
      sum +=
          n * forward_loss(cfg_, w_, eval_ids_.data() + int64_t(r) * o_.seq_len, n, o_.seq_len, T);
    }
    e.loss.emplace_back(T, sum / rows);
  }
  return e;
}

absl::Status Trainer::write_extra(const std::string& dir) const {
  const fs::path d(dir);
  CEMLM_RETURN_IF_ERROR(write_text((d / kTokenizerFile).string(), tokenizer_bytes_));
  CEMLM_RETURN_IF_ERROR(opt_->save((d / kOptimizerFile).string()));
  const json state = {{"format_version", 1},
                      {"step", step_},
                      {"tokens", tokens_},
                      {"elapsed_s", prior_elapsed_s_ + seconds_since(start_)},
                      {"data_rng", data_rng_.state()},
                      {"recursion_rng", t_rng_.state()},
                      {"compute_threads", compute_threads_},
                      {"split", kSplitRule},
                      {"validation_hash", val_hash_},
                      {"tokenizer_hash", hash_bytes(tokenizer_bytes_)},
                      {"options", json::parse(options_to_json(o_))}};
  CEMLM_RETURN_IF_ERROR(write_text((d / kTrainerStateFile).string(), state.dump(2) + "\n"));
  CEMLM_RETURN_IF_ERROR(write_text((d / kMetricsFile).string(), log_.jsonl()));
  return write_text((d / kLossCurveFile).string(),
                    log_.svg(absl::StrCat("cemlm train: ", cfg_.variant_name())));
}

absl::Status Trainer::save() {
  CEMLM_RETURN_IF_ERROR(
      save_checkpoint(out_.string(), cfg_, params_, /*tokenizer_path=*/"",
                      [this](const std::string& dir) { return write_extra(dir); }));
  if (cb_.on_save) cb_.on_save(step_, o_.out_dir);
  return absl::OkStatus();
}

// Tokenizer, parameters, data and the resumed state; CancelledError when the caller asks to stop
// before the first step (checked after each phase that may take long, and before each data file
// is encoded).
// A run killed while it wrote a cache file left its temporary "<file>.tmp.<pid>.<n>"
// (write_file_atomic's) there for good, megabytes each. Those of processes that are gone and
// untouched for 10 minutes are removed: a live one's may be a run sharing the cache, writing now
// (on another host too, whose process ids this one cannot see).
void Trainer::remove_dead_cache_temps() const {
  std::error_code ec;
  const auto stale = fs::file_time_type::clock::now() - std::chrono::minutes(10);
  for (fs::directory_iterator it(cache_path(), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    for (const char* file : {kTokenCacheFile, kTokenizerFile, kTokenizerKeyFile}) {
      const std::string prefix = absl::StrCat(file, ".tmp.");
      if (!absl::StartsWith(name, prefix)) continue;
      const std::vector<std::string> parts = absl::StrSplit(name.substr(prefix.size()), '.');
      int pid = 0;
      uint64_t n = 0;
      if (parts.size() == 2 && absl::SimpleAtoi(parts[0], &pid) && pid > 0 &&
          absl::SimpleAtoi(parts[1], &n) && ::kill(pid, 0) != 0 && errno == ESRCH &&
          fs::last_write_time(it->path(), ec) < stale && !ec) {
        std::error_code rm;
        if (fs::remove(it->path(), rm))
          info(absl::StrCat("removed ", it->path().string(), ", left by a run that was killed"));
      }
    }
  }
}

// --data's files, or the error that there are none to train on: before anything is written
// (a run refused for its data left --out's parents and lock file behind).
absl::StatusOr<CorpusFiles> Trainer::list_data() const {
  CEMLM_ASSIGN_OR_RETURN(CorpusFiles corpus,
                         list_corpus(o_.data, {out_path().string(), cache_path().string()}));
  if (!corpus.not_text.empty()) {
    constexpr size_t kNamed = 3;  // a directory of binaries should not flood the log
    const size_t n = corpus.not_text.size();
    const std::vector<std::string> named(corpus.not_text.begin(),
                                         corpus.not_text.begin() + std::min(n, kNamed));
    // (The hint where a file was left out for its bytes, not for being a FIFO or a device.)
    const bool bytes = std::any_of(
        corpus.not_text.begin(), corpus.not_text.end(),
        [](const std::string& why) { return absl::StrContains(why, "' is not UTF-8 text: "); });
    info(absl::StrCat(
        "note: --data: ", n, n == 1 ? " file" : " files", " left out: ", absl::StrJoin(named, "; "),
        n > kNamed ? absl::StrCat("; and ", n - kNamed, " more") : "",
        bytes ? " (convert a text file to UTF-8, e.g. with iconv, to train on it)" : ""));
  }
  if (const std::vector<std::string>& others = corpus.run_dirs; !others.empty())
    info(absl::StrCat(
        "note: --data: ", others.size(), others.size() == 1 ? " directory" : " directories",
        " of another run's checkpoint or token cache left out: ", absl::StrJoin(others, "; "),
        " (their JSON and token ids are not text to train on; name a file inside "
        "to train on it)"));
  if (corpus.paths.empty()) {
    // Data inside --cache or --out (`--cache .` run beside it) is all this run's own output.
    std::string inside;
    for (const std::string& d : o_.data)
      for (const auto& [flag, dir] : {std::pair{"--cache", cache_path()}, {"--out", out_path()}}) {
        std::error_code ec;
        const fs::path rel = fs::weakly_canonical(fs::absolute(d), ec)
                                 .lexically_relative(fs::weakly_canonical(fs::absolute(dir), ec));
        if (inside.empty() && !ec && !rel.empty() && *rel.begin() != "..")
          inside =
              absl::StrCat("; '", d, "' lies inside ", flag, " '", dir.string(),
                           "', whose files a run leaves out as its own: choose another ", flag);
      }
    return absl::InvalidArgumentError(absl::StrCat(
        "--data: no UTF-8 text file in ", absl::StrJoin(o_.data, ", "), " (", corpus.skipped.size(),
        " files skipped as .dat/.u8, binary, not UTF-8, not regular files or this run's own "
        "output)",
        inside));
  }
  return corpus;
}

absl::Status Trainer::set_up(const CorpusFiles& corpus) {
  remove_dead_cache_temps();
  CEMLM_RETURN_IF_ERROR(prepare_tokenizer(corpus));
  if (stop_asked(false)) return absl::CancelledError("stopped after the tokenizer");
  CEMLM_RETURN_IF_ERROR(prepare_params());
  // Before the data: a checkpoint that cannot be resumed was refused only once a corpus had been
  // encoded (minutes for a large one), its token cache written.
  if (o_.resume) CEMLM_RETURN_IF_ERROR(restore());
  CEMLM_RETURN_IF_ERROR(load_data(corpus));
  if (o_.resume) note_split_change();
  info(absl::StrCat("model: ", cfg_.variant_name(), ", ", params_.size(), " parameters; T ",
                    recursion_range_text(o_.train_recursion), " in training, evaluated at T ",
                    absl::StrJoin(eval_T_, ",")));
  if (const RecursionRange& r = o_.train_recursion;
      cfg_.has_cem() && (cfg_.recursion_default < r.min || cfg_.recursion_default > r.max))
    info(absl::StrCat("note: the model's recursion.default is ", cfg_.recursion_default,
                      ", outside the T ", recursion_range_text(r),
                      " it is trained at: requests that leave T unset will run at ",
                      cfg_.recursion_default,
                      "; set recursion.default in the config to change "
                      "that"));
  // Step s of the warmup runs at --lr · (s + 1) / --warmup: the last step of a run with
  // --warmup = --steps reaches --lr, and none decays.
  if (o_.warmup >= o_.steps)
    info(absl::StrCat(
        "note: --warmup ", o_.warmup, " is not below --steps ", o_.steps, ": the learning rate ",
        o_.warmup == o_.steps ? "reaches --lr only at the last step"
                              : absl::StrCat("never reaches --lr ", exact_number(o_.lr)),
        " and never decays; lower --warmup for a short run"));
  if (stop_asked(true)) return absl::CancelledError("stopped before the first step");
  return absl::OkStatus();
}

absl::StatusOr<TrainSummary> Trainer::run() {
  CEMLM_RETURN_IF_ERROR(validate_options(o_));
  const CpuThreads threads = use_cpu_threads(o_.threads);
  compute_threads_ = threads.threads;
  info(absl::StrCat("compute threads: ", threads.threads, " (", threads.why, ")"));
  absolute_paths(o_);
  // Once: a link re-pointed during the run redirected its saves into whatever it named then
  // (another run's checkpoint, whose lock was never taken).
  out_ = checkpoint_target_path(o_.out_dir);
  CEMLM_RETURN_IF_ERROR(check_paths_are_utf8());
  // A resumed run locks --out before loading it: an interrupted save may have left its checkpoint
  // aside, for remove_stale_saves to put back. (A new run's --out may not have a parent yet.)
  std::error_code ec;
  const fs::path parent = out_path().has_parent_path() ? out_path().parent_path() : ".";
  if (o_.resume && fs::is_directory(parent, ec)) {
    CEMLM_RETURN_IF_ERROR(lock_out());
    CEMLM_RETURN_IF_ERROR(remove_stale_saves());
  }
  CEMLM_RETURN_IF_ERROR(load_model());
  CEMLM_RETURN_IF_ERROR(check_against_model());
  CEMLM_ASSIGN_OR_RETURN(const CorpusFiles corpus, list_data());
  // A --tokenizer that does not load is refused before --out's folders and lock are made (set_up
  // loads it again, the one kept). A resumed run, or an --init checkpoint with its own, uses the
  // checkpoint's: the file the run started with may be gone.
  if (std::string error; tokenizer_path_.empty() && !o_.tokenizer_path.empty() &&
                         !Tokenizer::load(o_.tokenizer_path, &error))
    return absl::InvalidArgumentError(absl::StrCat("--tokenizer: ", error));
  if (lock_fd_ < 0) {
    CEMLM_RETURN_IF_ERROR(lock_out());
    // Again under the lock: a run on the same --out that ended while the data was listed (seconds
    // on a large corpus) left a checkpoint that this run's first save replaced.
    CEMLM_RETURN_IF_ERROR(check_out_is_new());
    CEMLM_RETURN_IF_ERROR(remove_stale_saves());
  }
  TrainSummary summary;
  if (const absl::Status ready = set_up(corpus); absl::IsCancelled(ready)) {
    info("stopped before the first step: nothing trained, nothing saved");
    summary.step = step_;
    return summary;
  } else if (!ready.ok()) {
    return ready;
  }

  summary.parameters = params_.size();
  start_ = Clock::now();
  bool stop = false, eval_measured = false;
  TimeBudget budget;
  // Before the first save: the weights and both moments written at ~200 MB/s.
  budget.save_s = double(params_.size()) * 4 * 3 / 2e8;
  batch_ids_.resize(size_t(o_.batch_size) * o_.seq_len);
  // A run whose T varies lays out a step's working memory at its largest T first (a step's
  // forward and backward on the data's first tokens, its gradients then discarded): a step at a
  // larger T than the steps before it grew the layout (its takes skipped chunks laid out for
  // another T), up to a fifth more memory, and a run that fits at its largest T was refused at
  // that step. A run that does not fit is refused here, before training.
  if (const RecursionRange& r = o_.train_recursion; r.min < r.max && step_ < o_.steps) {
    for (int b = 0; b < o_.batch_size; ++b)
      std::copy_n(data_.train.begin(), o_.seq_len, batch_ids_.begin() + int64_t(b) * o_.seq_len);
    try {
      forward_backward(cfg_, w_, gw_, batch_ids_.data(), o_.batch_size, o_.seq_len, r.max);
    } catch (const std::bad_alloc&) {
      return out_of_memory(o_, -1, false);
    }
  }
  while (step_ < o_.steps && !stop) {
    const Clock::time_point t0 = Clock::now();
    StepMetrics m;
    try {
      m = step();
    } catch (const std::bad_alloc&) {
      return out_of_memory(o_, step_, fs::exists(in_out(kConfigFile), ec));
    }
    train_s_ += seconds_since(t0);
    ++steps_run_;
    if (!finite_step(m, o_.clip)) return diverged(m, o_.clip, fs::exists(in_out(kConfigFile), ec));
    const double step_s = train_s_ / double(steps_run_);
    m.tokens_per_s = double(steps_run_) * o_.accum * o_.batch_size * o_.seq_len / train_s_;
    m.elapsed_s = prior_elapsed_s_ + seconds_since(start_);
    m.eta_s = double(o_.steps - step_) * step_s;
    log_.add(m);
    if (cb_.on_step && !cb_.on_step(m)) stop = true;
    budget.step_s = step_s;
    if (!eval_measured) budget.eval_s = estimated_eval_s(step_s);
    bool evaluated = false;
    auto run_eval = [&]() -> absl::Status {
      const Clock::time_point e0 = Clock::now();
      summary.last_eval = evaluate();
      budget.eval_s = seconds_since(e0);
      eval_measured = evaluated = true;
      log_.add(summary.last_eval);
      if (cb_.on_eval) cb_.on_eval(summary.last_eval);
      return finite_eval(summary.last_eval, fs::exists(in_out(kConfigFile), ec));
    };
    if (o_.max_minutes > 0 && step_ < o_.steps) {
      const double budget_s = o_.max_minutes * 60;
      const bool save_due = step_ % o_.save_every == 0;
      bool over = budget.stop_now(seconds_since(run_start_), budget_s, step_ % o_.eval_every == 0,
                                  save_due);
      // Before any evaluation was timed, its cost is estimated from the steps', which can be far
      // off (the first step's one-time costs made it 30× too long, and runs of a budget for
      // hundreds of steps stopped after one). An estimate alone does not stop the run: the
      // evaluation runs now, the final one if the run does stop, and the decision is remade.
      if (over && !eval_measured) {
        CEMLM_RETURN_IF_ERROR(run_eval());
        over = budget.stop_now(seconds_since(run_start_), budget_s, false, save_due);
      }
      if (over) {
        info(absl::StrCat("--max-minutes ", o_.max_minutes, " reached at step ", step_));
        stop = true;
      }
    }
    if (!evaluated && (stop || step_ == o_.steps || step_ % o_.eval_every == 0))
      CEMLM_RETURN_IF_ERROR(run_eval());
    // A stop asked for during the evaluation (a minute or more on a large validation set) ends
    // the run here, saved: it trained one more step and evaluated again before saving.
    auto stop_after = [&](bool saved) {
      return !stop && step_ < o_.steps && cb_.stop_after && cb_.stop_after(step_, saved);
    };
    if (evaluated && stop_after(false)) stop = true;
    if (step_ % o_.save_every == 0 || stop || step_ == o_.steps) {
      const Clock::time_point s0 = Clock::now();
      // A save between evaluations checks one batch of validation windows (a step's forward at
      // each depth), so that weights ruined since the last evaluation are not saved either.
      if (!evaluated)
        CEMLM_RETURN_IF_ERROR(
            finite_eval(evaluate(o_.batch_size), fs::exists(in_out(kConfigFile), ec)));
      CEMLM_RETURN_IF_ERROR(save());
      budget.save_s = seconds_since(s0);
      if (stop_after(true)) stop = true;  // asked for during the save: the run is saved
    }
  }
  if (steps_run_ == 0 && step_ >= o_.steps)
    info(absl::StrCat("the run in '", o_.out_dir, "' already did its ", step_,
                      " steps: raise --steps to train further"));
  summary.step = step_;
  summary.finished = step_ >= o_.steps;
  return summary;
}

}  // namespace

absl::StatusOr<TrainSummary> train(const TrainOptions& opts, const TrainCallbacks& callbacks) {
  Trainer trainer(opts, callbacks);
  return trainer.run();
}

}  // namespace cemlm
