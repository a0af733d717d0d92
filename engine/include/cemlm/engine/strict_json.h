// Strict JSON parsing for the files a checkpoint is read from (config.json, the safetensors
// header): a key named twice in one object is an error, not "the last one wins", and a syntax
// error says where it is.
#pragma once
#include <cstdint>
#include <limits>
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
//     "[i]"), the first one found;
//   - a number beyond a double: "not valid JSON at line L, column C (byte B): the number 1e999 is
//     beyond the range of a 64-bit float".
absl::StatusOr<nlohmann::json> parse_json_strict(std::string_view text);

// Whether `v` is an integer that a T holds. nlohmann's get<T> takes 2.5 as 2 and true as 1, and
// converts 1e300 or 2^64 - 1 into whatever the hardware makes of them (undefined behaviour for a
// double), so a count read from a file is checked with this first.
template <typename T, typename Json>
bool integer_fits(const Json& v) {
  using lim = std::numeric_limits<T>;
  if (v.is_number_unsigned()) return v.template get<uint64_t>() <= uint64_t(lim::max());
  if (!v.is_number_integer()) return false;
  const int64_t n = v.template get<int64_t>();
  return n >= 0 ? uint64_t(n) <= uint64_t(lim::max()) : lim::is_signed && n >= int64_t(lim::min());
}

}  // namespace cemlm
