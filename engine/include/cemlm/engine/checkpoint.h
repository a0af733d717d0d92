// Checkpoint directories (MODEL.md §8): config.json, model.safetensors, tokenizer.model.
// Loading checks every tensor against the layout table (param_layout); saving builds the whole
// directory beside the target and swaps it in, so a crash never leaves half a checkpoint.
#pragma once
#include <array>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cemlm/engine/config.h"
#include "cemlm/engine/params.h"

namespace cemlm {

inline constexpr char kConfigFile[] = "config.json";
inline constexpr char kWeightsFile[] = "model.safetensors";
inline constexpr char kTokenizerFile[] = "tokenizer.model";
// Files `cemlm train` adds to a checkpoint directory besides the model.
inline constexpr char kOptimizerFile[] = "optimizer.safetensors";
inline constexpr char kTrainerStateFile[] = "trainer_state.json";
inline constexpr char kMetricsFile[] = "train.jsonl";
inline constexpr char kLossCurveFile[] = "loss.svg";
// The files of `cemlm train`'s token cache directory (--cache): the encoded corpus, which starts
// with kTokenCacheMagic, and the key of the tokenizer it was encoded with.
inline constexpr char kTokenCacheFile[] = "tokens.bin";
inline constexpr char kTokenizerKeyFile[] = "tokenizer.key";
inline constexpr char kTokenCacheMagic[8] = {'C', 'E', 'M', 'L', 'M', 'T', 'O', 'K'};
// Every name a checkpoint directory may hold. Saving replaces the whole directory, so one
// holding anything else is refused rather than emptied.
inline constexpr std::array<std::string_view, 7> kCheckpointFiles = {
    kConfigFile, kWeightsFile, kTokenizerFile, kOptimizerFile, kTrainerStateFile, kMetricsFile,
    kLossCurveFile};

// The paths of the files of kCheckpointFiles in directory `dir` (whether they exist or not): what
// a command reading the checkpoint must not write over.
std::vector<std::string> checkpoint_file_paths(const std::string& dir);
// Empty when a command may write its output file `path`, else why not, naming `flag`: where it
// resolves, it is one of kCheckpointFiles of a checkpoint directory (config.json beside it), any
// checkpoint's, not only the command's input's (checkpoint_file_paths).
std::string checkpoint_file_error(const std::string& flag, const std::string& path);

struct Checkpoint {
  ModelConfig config;
  ParamStore params;
  std::string tokenizer_path;  // <dir>/tokenizer.model, or empty when the directory has none
};

// A checkpoint directory's config.json; one that is not a regular file (a FIFO would make the
// read wait forever for a writer) is refused.
absl::StatusOr<ModelConfig> load_checkpoint_config(const std::string& dir);

// <dir>/tokenizer.model when it is a regular file (through links), "" when there is no such
// entry; INVALID_ARGUMENT naming it when there is one that is no file to read (a directory, a
// FIFO, a device, a link to nothing): it was taken for "no tokenizer", and `train --init` then
// trained another one for the weights.
absl::StatusOr<std::string> checkpoint_tokenizer_path(const std::string& dir);

// Missing, extra or mis-shaped tensors, a truncated body and non-finite values are errors that
// name the tensor. BF16/F16 weights are converted to F32. The tokenizer as above.
absl::StatusOr<Checkpoint> load_checkpoint(const std::string& dir);

// Writes extra files (optimizer state, training progress) into the not-yet-published directory,
// so they appear atomically with the model. An error aborts the save.
using ExtraFilesWriter = std::function<absl::Status(const std::string& tmp_dir)>;

// The directory save_checkpoint writes for `dir`: "out/" is "out", and a symbolic link is
// followed, so the link keeps pointing at the new checkpoint.
std::filesystem::path checkpoint_target_path(const std::string& dir);

// The lock file a training run holds on `dir` while it runs: ".NAME.lock" beside the directory
// checkpoint_target_path gives (lock_path_of that directory).
std::filesystem::path checkpoint_lock_path(const std::string& dir);
std::filesystem::path lock_path_of(const std::filesystem::path& target);
// FAILED_PRECONDITION naming `flag`, the lock and its holder's pid while a process holds `dir`'s
// lock (a training run, whose next save would replace what is written there); OK when none does.
// Creates no lock file.
absl::Status check_checkpoint_unlocked(const std::string& dir, std::string_view flag);

// Whether save_checkpoint may write `dir`: absent, empty, or a checkpoint directory (config.json,
// and nothing but kCheckpointFiles), with a writable parent (or, when that is absent, a writable
// nearest ancestor: save_checkpoint creates the rest). Creates nothing. A trainer asks before
// training, so a bad --out fails at once rather than at the first save.
absl::Status check_checkpoint_target(const std::string& dir);
// Creates the directories above `dir` that are missing (save_checkpoint does; a trainer before
// its lock file, which sits beside `dir`).
absl::Status create_checkpoint_parent(const std::string& dir);

// Writes config.json, model.safetensors (F32, layout order) and, when `tokenizer_path` is not
// empty, a copy of it as tokenizer.model. An existing `dir` is replaced only once the new one is
// complete, and only if check_checkpoint_target allows it; a failed save leaves it
// untouched and removes the temporary directory. Non-finite parameters are refused by name.
absl::Status save_checkpoint(const std::string& dir, const ModelConfig& config,
                             const ParamStore& params, const std::string& tokenizer_path = "",
                             const ExtraFilesWriter& write_extra = nullptr);

}  // namespace cemlm
