// Corpus collection (see corpus.h): the directory walk, the skip rules and file reading.
#include "cemlm/engine/corpus.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <vector>

#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/utf8.h"

namespace cemlm {

namespace fs = std::filesystem;

namespace {

// Why fs::exists said no: a path that is not there, or one it could not follow (a loop of
// links: "Too many levels of symbolic links"; a directory it may not search).
std::string missing_or_why(const std::error_code& ec) {
  return ec ? "cannot be looked up: " + ec.message() : "does not exist";
}

}  // namespace

bool read_file(const std::string& path, std::string* bytes, std::string* error,
               uint64_t max_bytes) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    *error = "'" + path + "' " + missing_or_why(ec);
    return false;
  }
  if (!fs::is_regular_file(path, ec)) {
    *error = "'" + path + "' is not a regular file";
    return false;
  }
  const auto size = fs::file_size(path, ec);
  if (!ec && size > max_bytes) {
    *error = "'" + path + "' is " + std::to_string(size) + " bytes, more than the " +
             std::to_string(max_bytes) + " such a file can be (is it damaged?)";
    return false;
  }
  bytes->resize(ec ? 0 : size);
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in.is_open()) {  // why: "Permission denied", mostly
    *error = "cannot read '" + path + "'" +
             (errno ? std::string(" (") + std::strerror(errno) + ")" : "");
    return false;
  }
  if (ec || !in.read(bytes->data(), std::streamsize(bytes->size()))) {
    *error = "cannot read '" + path + "'";
    return false;
  }
  return true;
}

namespace {

bool skipped_by_name(const fs::path& p) {
  const auto ext = p.extension();
  return ext == ".dat" || ext == ".u8";
}

// Empty when `bytes` is UTF-8 text, else why not.
std::string why_not_text(const std::string& bytes) {
  if (auto nul = bytes.find('\0'); nul != std::string::npos)
    return "a NUL byte at offset " + std::to_string(nul) + " (binary file?)";
  if (size_t valid = utf8_valid_prefix(bytes); valid != bytes.size())
    return "invalid UTF-8 at byte offset " + std::to_string(valid);
  return "";
}

// why_not_text() of the file at `path`, read a MiB at a time (checking a corpus of large files
// holds none of them whole). False with *error when it cannot be read.
bool why_not_text_file(const std::string& path, std::string* why, std::string* error) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> chunk(size_t(1) << 20);
  std::string buf;             // a character the last chunk left unfinished, then this chunk
  size_t at = 0;               // the file offset of buf[0]
  size_t bad_utf8 = SIZE_MAX;  // the first invalid byte's offset: a NUL after it still wins
  while (in) {
    in.read(chunk.data(), std::streamsize(chunk.size()));
    if (in.bad()) break;
    const bool last = !in;  // the end of the file
    buf.append(chunk.data(), size_t(in.gcount()));
    if (const size_t nul = buf.find('\0'); nul != std::string::npos) {
      *why = "a NUL byte at offset " + std::to_string(at + nul) + " (binary file?)";
      return true;
    }
    const size_t body = buf.size() - (last ? 0 : utf8_unfinished_suffix(buf));
    if (const size_t valid = utf8_valid_prefix(std::string_view(buf).substr(0, body));
        valid != body && bad_utf8 == SIZE_MAX)
      bad_utf8 = at + valid;
    if (last) {
      why->clear();
      if (bad_utf8 != SIZE_MAX) *why = "invalid UTF-8 at byte offset " + std::to_string(bad_utf8);
      return true;
    }
    at += body;
    buf.erase(0, body);
  }
  *error = "cannot read '" + path + "'";
  return false;
}

std::string not_text_message(const std::string& path, const std::string& why) {
  return "'" + path + "' is not UTF-8 text: " + why;
}

// Appends the candidate files under `path` (sorted when it is a directory), what a directory
// holds that is no file or directory (a FIFO, socket, device, or a link to one or to nothing) to
// *others, and the directories of other runs' output it leaves unwalked to *run_dirs when given.
bool expand(const std::string& path, std::vector<std::string>* out,
            std::vector<std::string>* others, std::string* error,
            std::vector<std::string>* run_dirs) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    *error = "input '" + path + "' " + missing_or_why(ec);
    return false;
  }
  if (!fs::is_directory(path, ec)) {
    out->push_back(path);
    return true;
  }
  // Named itself, it was walked like a corpus (its JSON read as text): left out only below.
  if (is_run_output_dir(path)) {
    *error = "input '" + path +
             "' is a training run's checkpoint or token cache, not text to train on (its JSON "
             "and token ids are left out of a folder walked); name text files or a folder of them";
    return false;
  }
  // Links to directories are walked too (they were left out, uncounted): a link back to a
  // directory being walked is not (a loop), and a file reached twice counts once, by the first of
  // its paths in sorted order.
  std::vector<std::string> found;
  std::vector<fs::path> walking = {fs::canonical(path, ec)};  // [d]: the directory at depth d - 1
  fs::recursive_directory_iterator it(path, fs::directory_options::follow_directory_symlink, ec);
  for (const fs::recursive_directory_iterator end; !ec && it != end; it.increment(ec)) {
    if (it->path().filename().string().starts_with(".")) {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (it->is_directory(ec) && is_run_output_dir(it->path().string())) {
      it.disable_recursion_pending();
      if (run_dirs) run_dirs->push_back(it->path().string());
      continue;
    }
    if (it->is_directory(ec)) {
      walking.resize(size_t(it.depth()) + 1);
      std::error_code resolve;
      fs::path dir = fs::canonical(it->path(), resolve);
      if (resolve || std::find(walking.begin(), walking.end(), dir) != walking.end())
        it.disable_recursion_pending();
      else
        walking.push_back(std::move(dir));
      continue;
    }
    // (Left out, they were not counted among the files skipped: a corpus short of a file said
    // nothing of it.)
    (it->is_regular_file(ec) ? found : *others).push_back(it->path().string());
  }
  if (ec) {
    *error = "cannot list directory '" + path + "': " + ec.message();
    return false;
  }
  std::sort(found.begin(), found.end());
  // Among the files read: one skipped by its name (a ".u8" link to a fortune file) leaves the
  // file to its other path.
  std::set<fs::path> files;
  for (const std::string& f : found)
    if (std::error_code resolve;
        skipped_by_name(f) || files.insert(fs::canonical(f, resolve)).second || resolve)
      out->push_back(f);
  return true;
}

// Calls `use(path, text)` for every text file of `paths`, in order (`text` empty unless
// `with_text`); the walk behind both public collectors, so each file is read once.
bool for_each_text_file(const std::vector<std::string>& paths, bool with_text,
                        const std::function<void(const std::string&, std::string&&)>& use,
                        std::string* error, std::vector<std::string>* skipped,
                        std::vector<std::string>* why_skipped, std::vector<std::string>* run_dirs) {
  std::vector<std::string> candidates, others;
  for (const auto& p : paths)
    if (!expand(p, &candidates, &others, error, run_dirs)) return false;
  for (const auto& path : candidates) {
    std::string why;
    if (!skipped_by_name(path)) {
      std::string bytes;
      if (with_text) {
        if (!read_file(path, &bytes, error)) return false;
        why = why_not_text(bytes);
      } else if (std::error_code ec; !fs::is_regular_file(path, ec)) {
        read_file(path, &bytes, error);  // fails, saying why as it does for a whole read
        return false;
      } else if (!why_not_text_file(path, &why, error)) {
        return false;
      }
      if (why.empty()) {
        use(path, std::move(bytes));
        continue;
      }
      why = not_text_message(path, why);
    }
    if (skipped) skipped->push_back(path);
    if (why_skipped) why_skipped->push_back(std::move(why));
  }
  // After the files: by name first, as those are (a dangling ".u8" link says nothing more).
  std::sort(others.begin(), others.end());
  for (std::string& path : others) {
    if (why_skipped)
      why_skipped->push_back(skipped_by_name(path)
                                 ? std::string()
                                 : "'" + path +
                                       "' is not a regular file (a FIFO, socket or device, or a "
                                       "link to one or to nothing)");
    if (skipped) skipped->push_back(std::move(path));
  }
  return true;
}

}  // namespace

bool read_text_file(const std::string& path, std::string* text, std::string* error) {
  if (!read_file(path, text, error)) return false;
  if (std::string why = why_not_text(*text); !why.empty()) {
    *error = not_text_message(path, why);
    return false;
  }
  return true;
}

bool collect_text_files(const std::vector<std::string>& paths, std::vector<std::string>* files,
                        std::string* error, std::vector<std::string>* skipped,
                        std::vector<std::string>* why_skipped, std::vector<std::string>* run_dirs) {
  return for_each_text_file(
      paths, /*with_text=*/false,
      [&](const std::string& path, std::string&&) { files->push_back(path); }, error, skipped,
      why_skipped, run_dirs);
}

bool is_run_output_dir(const std::string& dir) {
  std::error_code ec;
  auto has = [&](const char* name) { return fs::exists(fs::path(dir) / name, ec); };
  if ((has(kConfigFile) && has(kWeightsFile)) || has(kTrainerStateFile)) return true;
  // A file of the user's may be called tokens.bin: the cache's starts with its magic.
  char magic[sizeof kTokenCacheMagic] = {};
  std::ifstream cache(fs::path(dir) / kTokenCacheFile, std::ios::binary);
  return cache.read(magic, sizeof magic) &&
         std::equal(magic, magic + sizeof magic, kTokenCacheMagic);
}

bool read_corpus(const std::vector<std::string>& paths, std::vector<TextFile>* files,
                 std::string* error, std::vector<std::string>* skipped,
                 std::vector<std::string>* run_dirs) {
  return for_each_text_file(
      paths, /*with_text=*/true,
      [&](const std::string& path, std::string&& text) {
        files->push_back(TextFile{path, std::move(text)});
      },
      error, skipped, nullptr, run_dirs);
}

}  // namespace cemlm
