// Shared by the benchmark programs: one line describing the machine (CPU model, cores), printed
// above every table so recorded numbers carry their context, a repeat-until-timed helper, and
// the small programs' argument parsing.
#pragma once
#include <charconv>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <initializer_list>
#include <string>
#include <thread>

#include "cemlm/kernels/blas_select.h"

namespace cemlm::bench {

// The CPU, its cores and BLAS; `gpu`: the program runs on a GPU (named on a line of its own).
inline std::string machine_line(bool gpu = false) {
  std::ifstream f("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  return "machine: " + model + ", " + std::to_string(std::thread::hardware_concurrency()) +
         " cores, " + (gpu ? "a GPU used (below)" : "no GPU used") + "; " + blas_description();
}

// Positional counts (each an integer ≥ 1) into *out[i], in order; those not given keep their
// values. Prints `usage` and returns 0 for --help or -h, or prints the bad argument and `usage`
// and returns 2 for anything else; -1 to go on.
inline int positional_counts(int argc, char** argv, const char* usage,
                             std::initializer_list<int*> out) {
  if (argc - 1 > int(out.size())) {
    std::fprintf(stderr, "unexpected argument '%s'\n%s", argv[out.size() + 1], usage);
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return std::fputs(usage, stdout), 0;
    int v = 0;
    const auto [end, ec] = std::from_chars(a.data(), a.data() + a.size(), v);
    if (ec != std::errc() || end != a.data() + a.size() || v < 1) {
      std::fprintf(stderr, "expected an integer >= 1, got '%s'\n%s", a.c_str(), usage);
      return 2;
    }
    *out.begin()[i - 1] = v;
  }
  return -1;
}

// The whole of `s` as an integer in [lo, hi] into *out; false otherwise (atoi read "abc" as 0
// and "8x" as 8).
inline bool parse_int_in(const char* s, int lo, int hi, int* out) {
  const std::string a = s;
  int v = 0;
  const auto [end, ec] = std::from_chars(a.data(), a.data() + a.size(), v);
  if (a.empty() || ec != std::errc() || end != a.data() + a.size() || v < lo || v > hi)
    return false;
  *out = v;
  return true;
}

// Seconds per call of fn, after one warm-up call, repeating for at least min_seconds.
template <typename F>
double seconds_per_call(F&& fn, double min_seconds = 1.0) {
  using Clock = std::chrono::steady_clock;
  fn();
  int reps = 0;
  const auto t0 = Clock::now();
  double el = 0;
  do {
    fn();
    ++reps;
    el = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (el < min_seconds);
  return el / reps;
}

}  // namespace cemlm::bench
