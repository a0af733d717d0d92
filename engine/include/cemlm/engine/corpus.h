// Text corpus collection for tokenizer and model training: expands files and directories into a
// deterministic list of UTF-8 text files and reads them. Abseil-free on purpose (tokenizer.cc,
// which may not include abseil, uses it): failures return false and fill `*error`.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace cemlm {

// Reads a whole file's bytes; false (error names the path) when it is missing, unreadable, or
// larger than `max_bytes`.
bool read_file(const std::string& path, std::string* bytes, std::string* error,
               uint64_t max_bytes = UINT64_MAX);

// Reads a whole file as UTF-8 text; false (error names the path) when it cannot be read or is
// not UTF-8 text (a NUL byte or an invalid sequence, with its byte offset).
bool read_text_file(const std::string& path, std::string* text, std::string* error);

// Expands `paths` (files, or directories walked recursively in sorted order, hidden entries
// skipped, links to directories followed but not around a loop, a file reached by two paths of a
// directory taken once) into the text files to train on, in input order. Skips `.dat`/`.u8` files
// (the strfile indexes and symlinked duplicates of Debian's fortunes), binary or non-UTF-8
// files, and what a directory holds that is no file (a FIFO, device, or link to one or to
// nothing), listing them in `*skipped` when given, and in `*why_skipped` (beside them, one for
// one) why: empty for a file left out by its name, unread, else "'path' is not UTF-8 text: ..."
// with the offending byte, or "'path' is not a regular file (...)". Each file is checked a MiB at a
// time, not held whole. False (error names the path) when a path does not exist or cannot be read,
// or names a directory of a training run's output (is_run_output_dir) itself. Such a directory
// found in the walk is not walked: it is listed in `*run_dirs` when given.
bool collect_text_files(const std::vector<std::string>& paths, std::vector<std::string>* files,
                        std::string* error, std::vector<std::string>* skipped = nullptr,
                        std::vector<std::string>* why_skipped = nullptr,
                        std::vector<std::string>* run_dirs = nullptr);

// Whether `dir` holds a checkpoint (config.json beside model.safetensors, or trainer_state.json)
// or `cemlm train`'s token cache (a tokens.bin that starts as one does): JSON, SVG and token keys
// that read as text, which a --data naming their parent took in as corpus.
bool is_run_output_dir(const std::string& dir);

struct TextFile {
  std::string path, text;
};

// collect_text_files plus the contents, each file read once.
bool read_corpus(const std::vector<std::string>& paths, std::vector<TextFile>* files,
                 std::string* error, std::vector<std::string>* skipped = nullptr,
                 std::vector<std::string>* run_dirs = nullptr);

}  // namespace cemlm
