// CRC-32C with the SSE4.2 crc32 instruction where the build targets it (8 bytes an instruction),
// else a byte table (builds for older x86-64 levels).
#include "cemlm/engine/crc32c.h"

#include <array>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace cemlm {
namespace {

#if !defined(__SSE4_2__)
constexpr uint32_t kPolynomial = 0x82F63B78;  // 0x1EDC6F41 bit-reversed

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ kPolynomial : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kTable = make_table();
#endif

}  // namespace

uint32_t crc32c(const void* bytes, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  uint32_t c = ~crc;
#if defined(__SSE4_2__)
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
  }
  c = uint32_t(c64);
  for (; n > 0; --n) c = _mm_crc32_u8(c, *p++);
#else
  for (; n > 0; --n) c = (c >> 8) ^ kTable[(c ^ *p++) & 0xFF];
#endif
  return ~c;
}

}  // namespace cemlm
