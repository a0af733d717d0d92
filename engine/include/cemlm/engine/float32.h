// Whether a number read as a double (a config key, a command-line flag) keeps its meaning as the
// 32-bit float that the kernels and the optimizer compute with. Shared by the config parser and
// the trainer's flag checks, with the words of their errors.
#pragma once
#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

namespace cemlm {

// A positive value is usable as a float when it rounds to a normal one: 1e-50 rounds to 0 (an
// epsilon that vanishes), 1e-40 to a subnormal (imprecise, and 0 under flush-to-zero).
inline bool positive_normal_float(double x) {
  return float(x) >= std::numeric_limits<float>::min();
}
// What an error says after the value when positive_normal_float(value) is false.
inline constexpr char kTooSmallForFloat[] =
    "is too small for a 32-bit float (0 or subnormal after rounding); the smallest is about "
    "1.2e-38";

// A value below 1 can round up to 1.0f: 0.99999999999 does.
inline bool below_one_as_float(double x) { return float(x) < 1.0f; }
// The largest value that stays below 1 (0.99999994), for the advice of an error.
inline float largest_float_below_one() { return std::nextafter(1.0f, 0.0f); }

// The shortest text that reads back as `x` (a float as a float), for an error that quotes a
// value: with 6 digits, a refused 1.0000001 read "= 1 is out of range (0, 1]", 1000000.1 "1e+06".
template <typename T>
requires std::is_floating_point_v<T> std::string exact_number(T x) {
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, x).ptr;
  return std::string(buf, end);
}

}  // namespace cemlm
