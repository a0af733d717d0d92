// Checkpoint load (layout-checked) and atomic save. Saving builds "<dir>.tmp-<pid>-<n>" and
// swaps it with the old directory in one renameat2(RENAME_EXCHANGE), so readers see either the
// old checkpoint or the new one, never a mix.
#include "cemlm/engine/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <unordered_set>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/engine/status.h"

namespace cemlm {
namespace {

namespace fs = std::filesystem;

// model.safetensors' __metadata__ entries that record how the weights split into heads.
constexpr char kHeadsKey[] = "n_heads";
constexpr char kHeadDimKey[] = "head_dim";

std::span<const float> values_of(const ParamStore& params, const ParamSpec& s) {
  return {params.flat().data() + s.offset, size_t(s.numel())};
}

absl::Status fs_error(const std::string& what, const fs::path& p, const std::error_code& ec) {
  return absl::UnavailableError(
      absl::StrCat("cannot ", what, " '", p.string(), "': ", ec.message()));
}

// The file holds exactly the tensors of `layout`, with its shapes. Checked before the parameters
// are allocated, so a config far larger than its weights is refused, not an out-of-memory abort.
absl::Status check_tensors(const SafetensorsFile& file, const std::vector<ParamSpec>& layout) {
  std::unordered_set<std::string> names;
  for (const ParamSpec& s : layout) names.insert(s.name);
  for (const TensorInfo& t : file.tensors())
    if (!names.count(t.name))
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": unexpected tensor '", absl::CHexEscape(t.name),
          "' (config.json's model has no such parameter: check that config.json belongs to these "
          "weights)"));
  for (const ParamSpec& s : layout) {
    const TensorInfo* t = file.find(s.name);
    if (!t)
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": missing tensor '", s.name, "' of shape ", shape_string(s.shape),
          " (config.json's model needs it: check that config.json belongs to these weights)"));
    if (t->shape != s.shape)
      return absl::InvalidArgumentError(
          absl::StrCat(file.path(), ": tensor '", s.name, "' has shape ", shape_string(t->shape),
                       ", config.json expects ", shape_string(s.shape)));
  }
  return absl::OkStatus();
}

// The split of the query/key width into heads shows in no tensor's shape (the standard attention
// and the shared diag term): a config.json edited to 2 heads of 64 where the weights learned 4
// of 32 loaded and generated other text. Saves record it; a file without it (another writer's,
// an older save) is not checked.
absl::Status check_heads(const SafetensorsFile& file, const ModelConfig& config) {
  for (const auto& [key, want] :
       {std::pair<const char*, int>{kHeadsKey, config.n_heads}, {kHeadDimKey, config.head_dim}}) {
    const auto it = file.metadata().find(key);
    if (it == file.metadata().end()) continue;
    if (int saved = 0; !absl::SimpleAtoi(it->second, &saved) || saved != want)
      return absl::InvalidArgumentError(absl::StrCat(
          file.path(), ": the weights were saved for ", key, " = ", absl::CHexEscape(it->second),
          ", config.json says ", want,
          " (the same tensor shapes, another model): restore config.json's n_heads and head_dim "
          "to the weights' (their __metadata__)"));
  }
  return absl::OkStatus();
}

absl::Status load_tensors(const SafetensorsFile& file, ParamStore& params) {
  for (const ParamSpec& s : params.specs())
    CEMLM_RETURN_IF_ERROR(
        file.read_f32(*file.find(s.name), {params.flat().data() + s.offset, size_t(s.numel())}));
  return absl::OkStatus();
}

// The store must have been built for this config, else the file would contradict config.json.
absl::Status check_params(const ModelConfig& config, const ParamStore& params) {
  const std::vector<ParamSpec> layout = param_layout(config);
  bool same = layout.size() == params.specs().size();
  for (size_t i = 0; same && i < layout.size(); ++i)
    same = layout[i].name == params.specs()[i].name && layout[i].shape == params.specs()[i].shape;
  if (!same)
    return absl::InvalidArgumentError(
        "save_checkpoint: the parameters were not built for this config (layouts differ)");
  for (const ParamSpec& s : params.specs())
    for (float x : values_of(params, s))
      if (!std::isfinite(x))
        return absl::InvalidArgumentError(absl::StrCat(
            "save_checkpoint: tensor '", s.name,
            "' holds a non-finite value (training diverged?); refusing to overwrite a checkpoint"));
  return absl::OkStatus();
}

// fsync by path, of a file or a directory (its entries). Best effort: what it guards against is a
// power loss, not a kill, and a filesystem that cannot sync still holds the files.
void sync_path(const fs::path& path) {
  const int fd = ::open(path.empty() ? "." : path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

absl::Status write_contents(const fs::path& tmp, const ModelConfig& config,
                            const ParamStore& params, const std::string& tokenizer_path,
                            const ExtraFilesWriter& write_extra) {
  const std::string json = config_to_json(config);
  CEMLM_RETURN_IF_ERROR(write_file_atomic((tmp / kConfigFile).string(), [&](std::FILE* f) {
    return std::fwrite(json.data(), 1, json.size(), f) == json.size()
               ? absl::OkStatus()
               : absl::UnavailableError(absl::StrCat("cannot write ", kConfigFile));
  }));
  std::vector<NamedTensor> tensors;
  for (const ParamSpec& s : params.specs())
    tensors.push_back(NamedTensor{s.name, s.shape, values_of(params, s)});
  CEMLM_RETURN_IF_ERROR(write_safetensors((tmp / kWeightsFile).string(), tensors,
                                          {{"format", "pt"},
                                           {"variant", config.variant_name()},
                                           {kHeadsKey, std::to_string(config.n_heads)},
                                           {kHeadDimKey, std::to_string(config.head_dim)}}));
  if (!tokenizer_path.empty()) {
    std::error_code ec;
    fs::copy_file(tokenizer_path, tmp / kTokenizerFile, ec);
    if (ec) return fs_error("copy the tokenizer", tokenizer_path, ec);
    sync_path(tmp / kTokenizerFile);  // the other files are synced as they are written
  }
  return write_extra ? write_extra(tmp.string()) : absl::OkStatus();
}

// Whether `dir` is the root of a mount (a Docker or Kubernetes volume): the kernel's word where it
// has one (Linux 5.8 on), else a device other than its parent's (a bind mount of the same
// filesystem then goes unseen).
bool is_mount_point(const fs::path& dir) {
  struct statx sx {};
  if (::statx(AT_FDCWD, dir.c_str(), 0, STATX_BASIC_STATS, &sx) == 0 &&
      (sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT))
    return (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT) != 0;
  struct stat self {
  }, parent{};
  return ::stat(dir.c_str(), &self) == 0 && ::stat((dir / "..").c_str(), &parent) == 0 &&
         self.st_dev != parent.st_dev;
}

// Replaces `target` with `tmp`; afterwards `tmp`, if it still exists, holds what is to delete.
absl::Status publish(const fs::path& tmp, const fs::path& target, bool target_exists) {
  if (!target_exists) {
    if (std::rename(tmp.c_str(), target.c_str()) != 0)
      return absl::UnavailableError(
          absl::StrCat("cannot rename onto '", target.string(), "': ", std::strerror(errno)));
    return absl::OkStatus();
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0)
    return absl::OkStatus();
  if (errno != EINVAL && errno != ENOSYS)
    return absl::UnavailableError(
        absl::StrCat("cannot swap in '", target.string(), "': ", std::strerror(errno)));
  // The filesystem cannot exchange: move the old one aside first (a short window without it).
  const fs::path old = fs::path(tmp.string() + ".old");
  if (std::rename(target.c_str(), old.c_str()) != 0)
    return absl::UnavailableError(
        absl::StrCat("cannot move '", target.string(), "' aside: ", std::strerror(errno)));
  if (std::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    std::rename(old.c_str(), target.c_str());
    return absl::UnavailableError(
        absl::StrCat("cannot rename onto '", target.string(), "': ", std::strerror(err)));
  }
  std::error_code ec;
  fs::remove_all(old, ec);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> load_checkpoint_config(const std::string& dir) {
  // "" / "config.json" would be the working directory's.
  if (dir.empty())
    return absl::InvalidArgumentError(
        "the checkpoint directory is empty: name one (with config.json and model.safetensors)");
  if (struct stat sb{}; ::stat(dir.c_str(), &sb) == 0 && !S_ISDIR(sb.st_mode))
    return absl::InvalidArgumentError(
        absl::StrCat("'", dir,
                     "' is not a directory: name the checkpoint directory, the one that holds "
                     "config.json and model.safetensors"));
  const fs::path path = fs::path(dir) / kConfigFile;
  // As for the weights: a FIFO as config.json would make the load wait forever for a writer.
  // (load_config itself does not refuse one: a --config given to init or train may be a pipe.)
  if (struct stat sb{};
      ::stat(path.c_str(), &sb) == 0 && !S_ISREG(sb.st_mode) && !S_ISDIR(sb.st_mode))
    return absl::InvalidArgumentError(
        absl::StrCat("config: '", path.string(), "' is not a regular file, not a config.json"));
  return load_config(path.string());
}

absl::StatusOr<Checkpoint> load_checkpoint(const std::string& dir) {
  const fs::path root(dir);
  Checkpoint ck;
  CEMLM_ASSIGN_OR_RETURN(ck.config, load_checkpoint_config(dir));
  const auto layout = param_layout(ck.config);
  const std::string weights = (root / kWeightsFile).string();
  // Said as a checkpoint's file: the reader's own words point at a .safetensors path.
  struct stat sb {};
  const bool found = ::stat(weights.c_str(), &sb) == 0;
  const bool missing = !found && errno == ENOENT;
  if (std::error_code ec; missing && fs::is_symlink(weights, ec))
    return absl::NotFoundError(absl::StrCat("'", weights, "' is a symbolic link to '",
                                            fs::read_symlink(weights, ec).string(),
                                            "', which does not exist: point it at the weights"));
  if (missing)
    return absl::NotFoundError(absl::StrCat("'", dir, "' has config.json but no ", kWeightsFile,
                                            ": a checkpoint holds both (cemlm init and cemlm "
                                            "train write them); copy its weights there"));
  if (found && !S_ISREG(sb.st_mode))
    return absl::InvalidArgumentError(absl::StrCat(
        "'", weights, "' is ", S_ISDIR(sb.st_mode) ? "a directory" : "not a regular file",
        ": a checkpoint's ", kWeightsFile, " must be its weights file"));
  CEMLM_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(weights, layout.size()));
  CEMLM_RETURN_IF_ERROR(check_tensors(file, layout));
  CEMLM_RETURN_IF_ERROR(check_heads(file, ck.config));
  ck.params = ParamStore(ck.config);
  CEMLM_RETURN_IF_ERROR(load_tensors(file, ck.params));
  CEMLM_ASSIGN_OR_RETURN(ck.tokenizer_path, checkpoint_tokenizer_path(dir));
  return ck;
}

absl::StatusOr<std::string> checkpoint_tokenizer_path(const std::string& dir) {
  const fs::path path = fs::path(dir) / kTokenizerFile;
  std::error_code ec;
  const fs::file_status entry = fs::symlink_status(path, ec);
  if (entry.type() == fs::file_type::not_found) return std::string();
  const fs::file_status target = fs::status(path, ec);
  if (target.type() == fs::file_type::regular) return path.string();
  return absl::InvalidArgumentError(absl::StrCat(
      "'", path.string(), "' is ",
      target.type() == fs::file_type::not_found ? "a link to nothing"
      : ec                                      ? absl::StrCat("unreadable (", ec.message(), ")")
                                                : "not a regular file",
      ": replace it with the tokenizer of these weights, or remove it (the model then takes "
      "token ids only)"));
}

fs::path checkpoint_target_path(const std::string& dir) {
  fs::path target = fs::path(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();  // "out/" → "out"
  // Followed link by link: weakly_canonical leaves a link to a directory not made yet as it is.
  std::error_code ec;
  for (int hops = 0; hops < 40 && fs::is_symlink(target, ec); ++hops) {
    fs::path to = fs::read_symlink(target, ec);
    if (ec) break;
    target = (to.is_relative() ? target.parent_path() / to : to).lexically_normal();
    if (!target.has_filename()) target = target.parent_path();
  }
  return target;
}

fs::path lock_path_of(const fs::path& target) {
  return target.parent_path() / ("." + target.filename().string() + ".lock");
}

fs::path checkpoint_lock_path(const std::string& dir) {
  return lock_path_of(checkpoint_target_path(dir));
}

absl::Status check_checkpoint_unlocked(const std::string& dir, std::string_view flag) {
  const fs::path lock = checkpoint_lock_path(dir);
  const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::OkStatus();  // no run ever locked it (or none can be seen)
  const bool held = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  char pid[32] = {};
  const ssize_t n = held ? ::pread(fd, pid, sizeof(pid) - 1, 0) : 0;
  ::close(fd);  // and with it the shared lock, when it was taken
  if (!held) return absl::OkStatus();
  const std::string f(flag);
  return absl::FailedPreconditionError(absl::StrCat(
      f, " '", dir, "' is in use: a cemlm train run",
      n > 0 ? absl::StrCat(" (pid ", std::string(pid, size_t(n)), ")") : "", " holds its lock '",
      lock.string(),
      "' and its next save would replace what is written there; wait for that run to end, or "
      "choose another ",
      f));
}

absl::Status check_checkpoint_target(const std::string& dir) {
  const fs::path target = checkpoint_target_path(dir);
  if (target.empty() || target == "." || target == "..")
    return absl::InvalidArgumentError(absl::StrCat(
        "'", dir, "' cannot hold a checkpoint: name a directory of its own, like models/run1"));
  std::error_code ec;
  if (fs::exists(target, ec) && (!fs::is_directory(target, ec) ||
                                 (!fs::exists(target / kConfigFile, ec) && !fs::is_empty(target, ec))))
    return absl::FailedPreconditionError(absl::StrCat(
        "'", target.string(),
        "' exists and is not a checkpoint directory (no config.json); refusing to replace it: "
        "choose another output directory or remove it"));
  if (fs::is_directory(target, ec) && is_mount_point(target))
    return absl::FailedPreconditionError(absl::StrCat(
        "'", target.string(),
        "' is a mount point (a volume): a save swaps a new directory in for it, which a mount "
        "point cannot be; write into a directory inside it, like ",
        (target / "run1").string(), " (and serve that)"));
  if (fs::is_directory(target, ec))
    for (fs::directory_iterator it(target, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (std::find(kCheckpointFiles.begin(), kCheckpointFiles.end(), name) ==
              kCheckpointFiles.end() ||
          !it->is_regular_file(ec))
        return absl::FailedPreconditionError(absl::StrCat(
            "'", target.string(), "' holds '", name,
            "', which is not a checkpoint file; saving replaces the whole directory and would "
            "delete it: move it out, or choose another output directory"));
    }
  // Nothing is created here (a run refused later, for a flag, left --out's parents behind): the
  // parent, or the nearest of its ancestors that exists, must be a directory one may write in.
  fs::path parent = target.parent_path();
  while (!parent.empty() && !fs::exists(parent, ec) && parent != parent.parent_path())
    parent = parent.parent_path();
  if (parent.empty()) parent = ".";
  if (!fs::is_directory(parent, ec))
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write a checkpoint under '", parent.string(), "': not a directory"));
  if (::access(parent.c_str(), W_OK) != 0)
    return absl::PermissionDeniedError(absl::StrCat(
        "cannot write a checkpoint into '", parent.string(), "': ", std::strerror(errno)));
  return absl::OkStatus();
}

absl::Status create_checkpoint_parent(const std::string& dir) {
  const fs::path target = checkpoint_target_path(dir);
  std::error_code ec;
  if (target.has_parent_path() && !fs::create_directories(target.parent_path(), ec) && ec)
    return fs_error("create", target.parent_path(), ec);
  return absl::OkStatus();
}

absl::Status save_checkpoint(const std::string& dir, const ModelConfig& config,
                             const ParamStore& params, const std::string& tokenizer_path,
                             const ExtraFilesWriter& write_extra) {
  CEMLM_RETURN_IF_ERROR(check_params(config, params));
  CEMLM_RETURN_IF_ERROR(check_checkpoint_target(dir));
  CEMLM_RETURN_IF_ERROR(create_checkpoint_parent(dir));
  const fs::path target = checkpoint_target_path(dir);
  std::error_code ec;
  const bool exists = fs::exists(target, ec);
  static std::atomic<uint64_t> counter{0};
  const fs::path tmp = absl::StrCat(target.string(), ".tmp-", ::getpid(), "-", counter++);
  if (!fs::create_directory(tmp, ec))
    return fs_error("create", tmp, ec ? ec : std::make_error_code(std::errc::file_exists));
  absl::Status st;
  // The replaced directory's mode and owners go on: a `chmod 700` on a private checkpoint was
  // undone by the next save. (Owners as far as allowed: a group one belongs to, or root's any.)
  if (struct stat was{}; exists && ::stat(target.c_str(), &was) == 0) {
    if (::chown(tmp.c_str(), was.st_uid, was.st_gid) != 0)
      (void)!::chown(tmp.c_str(), uid_t(-1), was.st_gid);
    if (::chmod(tmp.c_str(), was.st_mode & 07777) != 0)
      st = fs_error("set the mode of", tmp, std::error_code(errno, std::generic_category()));
  }
  if (st.ok()) st = write_contents(tmp, config, params, tokenizer_path, write_extra);
  // Its entries before the swap that publishes them, the swap itself after.
  if (st.ok()) sync_path(tmp);
  if (st.ok()) st = publish(tmp, target, exists);
  fs::remove_all(tmp, ec);
  if (st.ok()) sync_path(target.parent_path());
  return st;
}

std::string checkpoint_file_error(const std::string& flag, const std::string& path) {
  std::error_code ec;
  const fs::path file = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec ||
      std::find(kCheckpointFiles.begin(), kCheckpointFiles.end(), file.filename().string()) ==
          kCheckpointFiles.end() ||
      !fs::exists(file.parent_path() / kConfigFile, ec))
    return "";
  return absl::StrCat(flag, " '", path, "' is a file of the checkpoint '",
                      file.parent_path().string(),
                      "': writing it would break that checkpoint; name another file");
}

std::vector<std::string> checkpoint_file_paths(const std::string& dir) {
  std::vector<std::string> paths;
  for (const std::string_view name : kCheckpointFiles)
    paths.push_back((std::filesystem::path(dir) / name).string());
  return paths;
}

}  // namespace cemlm
