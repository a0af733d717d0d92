// Shared by the benchmark programs: one line describing the machine (CPU model, cores), printed
// above every table so recorded numbers carry their context, and a repeat-until-timed helper.
#pragma once
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "cemlm/kernels/blas_select.h"

namespace cemlm::bench {

inline std::string machine_line() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  return "machine: " + model + ", " + std::to_string(std::thread::hardware_concurrency()) +
         " cores, no GPU used; " + blas_description();
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
