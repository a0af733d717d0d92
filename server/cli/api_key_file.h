// `cemlm serve`'s --api-key-file: read at start, then again on SIGHUP and, with
// --api-key-reload-interval, whenever its text changes (a rotated Kubernetes Secret, an edit in
// place), with no signal; a file written in the last 2 s waits for a later look, so that one
// being written is not taken half-way. A text that cannot be read or does not load leaves the
// keys served as they were, and the log says why, once per text.
#pragma once
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "cemlm/server/auth.h"

namespace cemlm::cli {

class ApiKeyFile {
 public:
  explicit ApiKeyFile(std::string path) : path_(std::move(path)) {}
  const std::string& path() const { return path_; }
  // Reads the file and parses its keys (at start). Errors name the flag, the file and the line.
  absl::StatusOr<server::ApiKeys> load();
  // Reads the file again: the keys to serve when its text loads (with `changed_only`, only when
  // that text differs from the last read's and was not written in the last 2 s), nullopt
  // otherwise. Errors are logged, after `why` ("SIGHUP", …), each followed by "; the keys served
  // are unchanged".
  std::optional<server::ApiKeys> reload(std::string_view why, bool changed_only);

 private:
  std::string path_;
  std::optional<std::string> text_;  // at the last read; nullopt when it could not be read
};

}  // namespace cemlm::cli
