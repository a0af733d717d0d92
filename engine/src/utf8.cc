// Strict UTF-8 validation (see utf8.h), following the well-formed byte sequences table of the
// Unicode standard (§3.9, table 3-7).
#include "cemlm/engine/utf8.h"

#include <cstdint>

namespace cemlm {
namespace {

// Bytes taken by the well-formed sequence starting at s[i], or 0 when none starts there.
size_t sequence_length(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return uint8_t(s[i + k]); };
  const uint8_t b0 = byte(0);
  if (b0 < 0x80) return 1;
  size_t n = 0;
  // The allowed range of the second byte is what excludes overlong forms, surrogates and code
  // points above U+10FFFF.
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size() || byte(1) < lo || byte(1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (byte(k) < 0x80 || byte(k) > 0xBF) return 0;
  return n;
}

}  // namespace

size_t utf8_valid_prefix(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t n = sequence_length(s, i);
    if (n == 0) break;
    i += n;
  }
  return i;
}

}  // namespace cemlm
