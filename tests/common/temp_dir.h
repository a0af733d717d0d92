// Temporary directories for tests, removed when they are done with: a directory made inside a
// test goes when that test ends, one made outside a test (SetUpTestSuite, a fixture's static
// setup) when the program ends. A failed test's directories are kept and named on stderr, for a
// look at what it left. Every test binary of the suite gets this header's directory on its
// include path (tests/CMakeLists.txt).
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

namespace cemlm::testing_temp {

namespace detail {

// Removes or reports the directories handed to it; appended to gtest's listeners on first use.
class Cleaner : public ::testing::EmptyTestEventListener {
 public:
  void add(const std::filesystem::path& dir, bool in_test) {
    std::lock_guard<std::mutex> lock(mu_);
    (in_test ? test_dirs_ : program_dirs_).push_back(dir);
  }

 private:
  void OnTestEnd(const ::testing::TestInfo& info) override { finish(test_dirs_, !info.result()->Failed()); }
  void OnTestProgramEnd(const ::testing::UnitTest& unit) override {
    finish(test_dirs_, !unit.Failed());
    finish(program_dirs_, !unit.Failed());
  }
  void finish(std::vector<std::filesystem::path>& dirs, bool passed) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& dir : dirs) {
      std::error_code ec;
      if (passed)
        std::filesystem::remove_all(dir, ec);
      else
        std::fprintf(stderr, "kept the failed test's directory %s\n", dir.c_str());
    }
    dirs.clear();
  }

  std::mutex mu_;
  std::vector<std::filesystem::path> test_dirs_, program_dirs_;
};

inline Cleaner& cleaner() {
  // Owned by gtest's listener list once appended; never deleted before the program ends.
  static Cleaner* c = [] {
    auto* made = new Cleaner;
    ::testing::UnitTest::GetInstance()->listeners().Append(made);
    return made;
  }();
  return *c;
}

}  // namespace detail

// A new, empty directory named after `tag`, the running test (if any), the process id and how
// many this process made before, under gtest's temporary directory; removed as the header
// comment says. (Two calls in one test get two directories.)
inline std::string fresh_dir(const std::string& tag) {
  static std::atomic<int> made{0};
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = "cemlm_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(made++);
  if (info) name += std::string("_") + info->test_suite_name() + "_" + info->name();
  for (char& c : name)
    if (c == '/') c = '_';  // parameterized tests name themselves Suite/Test/0
  const auto dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  detail::cleaner().add(dir, info != nullptr);
  return dir.string();
}

}  // namespace cemlm::testing_temp
