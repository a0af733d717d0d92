// Corpus collection (see corpus.h): the directory walk, the skip rules and file reading.
#include "cemlm/engine/corpus.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>

#include "cemlm/engine/utf8.h"

namespace cemlm {

namespace fs = std::filesystem;

bool read_file(const std::string& path, std::string* bytes, std::string* error) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    *error = "'" + path + "' does not exist";
    return false;
  }
  if (!fs::is_regular_file(path, ec)) {
    *error = "'" + path + "' is not a regular file";
    return false;
  }
  const auto size = fs::file_size(path, ec);
  bytes->resize(ec ? 0 : size);
  std::ifstream in(path, std::ios::binary);
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

std::string not_text_message(const std::string& path, const std::string& why) {
  return "'" + path + "' is not UTF-8 text: " + why;
}

// Appends the candidate files under `path` (sorted when it is a directory).
bool expand(const std::string& path, std::vector<std::string>* out, std::string* error) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    *error = "input '" + path + "' does not exist";
    return false;
  }
  if (!fs::is_directory(path, ec)) {
    out->push_back(path);
    return true;
  }
  std::vector<std::string> found;
  fs::recursive_directory_iterator it(path, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    if (it->path().filename().string().starts_with(".")) {
      if (it->is_directory(ec)) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file(ec)) found.push_back(it->path().string());
  }
  if (ec) {
    *error = "cannot list directory '" + path + "': " + ec.message();
    return false;
  }
  std::sort(found.begin(), found.end());
  out->insert(out->end(), found.begin(), found.end());
  return true;
}

// Calls `use(path, text)` for every text file of `paths`, in order; the walk behind both public
// collectors, so each file is read once.
bool for_each_text_file(const std::vector<std::string>& paths,
                        const std::function<void(const std::string&, std::string&&)>& use,
                        std::string* error, std::vector<std::string>* skipped,
                        std::vector<std::string>* why_skipped) {
  std::vector<std::string> candidates;
  for (const auto& p : paths)
    if (!expand(p, &candidates, error)) return false;
  for (const auto& path : candidates) {
    std::string why;
    if (!skipped_by_name(path)) {
      std::string bytes;
      if (!read_file(path, &bytes, error)) return false;
      why = why_not_text(bytes);
      if (why.empty()) {
        use(path, std::move(bytes));
        continue;
      }
      why = not_text_message(path, why);
    }
    if (skipped) skipped->push_back(path);
    if (why_skipped) why_skipped->push_back(std::move(why));
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
                        std::vector<std::string>* why_skipped) {
  return for_each_text_file(
      paths, [&](const std::string& path, std::string&&) { files->push_back(path); }, error,
      skipped, why_skipped);
}

bool read_corpus(const std::vector<std::string>& paths, std::vector<TextFile>* files,
                 std::string* error, std::vector<std::string>* skipped) {
  return for_each_text_file(
      paths,
      [&](const std::string& path, std::string&& text) {
        files->push_back(TextFile{path, std::move(text)});
      },
      error, skipped, nullptr);
}

}  // namespace cemlm
