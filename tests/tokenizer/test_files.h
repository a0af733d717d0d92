// Shared by the tokenizer tests: a fresh temporary directory per test, small file writers, and
// the Debian fortunes files the tokenizer is trained on (installed by the setup).
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace cemlm::testing_files {

inline const std::string kFortunes = "/usr/share/games/fortunes";

// An empty directory unique to the running test.
inline std::string fresh_temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = "cemlm_" + std::to_string(::getpid()) + "_" +
                     (info ? std::string(info->test_suite_name()) + "_" + info->name() : "suite");
  auto dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

// Two small fortunes files (~40 KB): enough text to train a few-hundred-piece tokenizer quickly.
inline std::vector<std::string> small_corpus() {
  return {kFortunes + "/fortunes", kFortunes + "/debian"};
}

}  // namespace cemlm::testing_files
