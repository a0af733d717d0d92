// Strict UTF-8 validation (see utf8.h), following the well-formed byte sequences table of the
// Unicode standard (§3.9, table 3-7).
#include "cemlm/engine/utf8.h"

#include <algorithm>
#include <cstdint>

namespace cemlm {
namespace {

// The length of the well-formed sequence that lead byte b0 starts (0 when it starts none) and the
// allowed range of its second byte, which is what excludes overlong forms, surrogates and code
// points above U+10FFFF.
size_t lead_length(uint8_t b0, uint8_t* lo, uint8_t* hi) {
  *lo = 0x80, *hi = 0xBF;
  if (b0 < 0x80) return 1;
  if (b0 >= 0xC2 && b0 <= 0xDF) return 2;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (b0 == 0xE0) *lo = 0xA0;
    if (b0 == 0xED) *hi = 0x9F;
    return 3;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (b0 == 0xF0) *lo = 0x90;
    if (b0 == 0xF4) *hi = 0x8F;
    return 4;
  }
  return 0;
}

bool is_continuation(uint8_t b) { return b >= 0x80 && b <= 0xBF; }

// Bytes taken by the well-formed sequence starting at s[i], or 0 when none starts there.
size_t sequence_length(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return uint8_t(s[i + k]); };
  uint8_t lo, hi;
  const size_t n = lead_length(byte(0), &lo, &hi);
  if (n <= 1) return n;
  if (i + n > s.size() || byte(1) < lo || byte(1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (!is_continuation(byte(k))) return 0;
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

size_t utf8_unfinished_suffix(std::string_view s) {
  for (size_t k = 1; k <= std::min<size_t>(3, s.size()); ++k) {
    const size_t at = s.size() - k;
    if (is_continuation(uint8_t(s[at]))) continue;  // the lead byte, if any, is further back
    uint8_t lo, hi;
    const size_t n = lead_length(uint8_t(s[at]), &lo, &hi);
    if (n <= k) return 0;  // not a lead byte, or its character is complete
    if (k >= 2 && (uint8_t(s[at + 1]) < lo || uint8_t(s[at + 1]) > hi)) return 0;
    return k;
  }
  return 0;
}

}  // namespace cemlm
