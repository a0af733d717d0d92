// UTF-8 validation for anything that crosses an edge as text: request prompts (the server), corpus
// files (the trainer) and stop strings. Strict: overlong forms, surrogates and code points above
// U+10FFFF are invalid. No dependencies, so the tokenizer and the server can both use it.
#pragma once
#include <cstddef>
#include <string_view>

namespace cemlm {

// Length in bytes of the longest prefix of `s` that is valid UTF-8 (s.size() when all of it is).
size_t utf8_valid_prefix(std::string_view s);

inline bool is_valid_utf8(std::string_view s) { return utf8_valid_prefix(s) == s.size(); }

}  // namespace cemlm
