// UTF-8 validation for anything that crosses an edge as text: request prompts (the server), corpus
// files (the trainer) and stop strings. Strict: overlong forms, surrogates and code points above
// U+10FFFF are invalid. No dependencies, so the tokenizer and the server can both use it.
#pragma once
#include <cstddef>
#include <string_view>

namespace cemlm {

// Length in bytes of the longest prefix of `s` that is valid UTF-8 (s.size() when all of it is).
size_t utf8_valid_prefix(std::string_view s);

// Length (0 to 3) of the tail of `s` that starts a character without finishing it: a lead byte
// followed by fewer continuation bytes than it announces, each in its allowed range, so that more
// bytes can still make it a well-formed character. 0 when `s` ends otherwise (a finished
// character, or bytes that no continuation can make well-formed).
size_t utf8_unfinished_suffix(std::string_view s);

inline bool is_valid_utf8(std::string_view s) { return utf8_valid_prefix(s) == s.size(); }

}  // namespace cemlm
