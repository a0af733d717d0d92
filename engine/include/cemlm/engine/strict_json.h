// Strict JSON parsing for the files a checkpoint is read from (config.json, the safetensors
// header): a key named twice in one object is an error, not "the last one wins", and a syntax
// error says where it is.
#pragma once
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace cemlm {

// Parses `text` as one JSON value. INVALID_ARGUMENT on
//   - a syntax error: "not valid JSON at line L, column C (byte B): <what>", where B is the
//     0-based offset of the offending byte and L, C count from 1 (C in bytes);
//   - arrays/objects nested more than 64 deep: "not valid JSON at line L, column C (byte B):
//     nested more than 64 arrays/objects deep ..." at the bracket that opens level 65 (checked
//     before parsing, so a file of brackets costs neither memory nor stack);
//   - a NUL byte anywhere: "not valid JSON at line L, column C (byte B): a NUL byte ..." (the
//     parser alone would stop reading at it and accept what came before);
//   - a repeated key: "duplicate key \"a.b\"" (the dotted path of the key; array elements as
//     "[i]"), the first one found.
absl::StatusOr<nlohmann::json> parse_json_strict(std::string_view text);

}  // namespace cemlm
