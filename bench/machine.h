// One line describing the machine a benchmark ran on (CPU model, cores, GPU if any), printed
// above every benchmark table so recorded numbers carry their context.
#pragma once
#include <fstream>
#include <string>
#include <thread>

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
         " cores, no GPU used";
}

}  // namespace cemlm::bench
