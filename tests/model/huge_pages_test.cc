// HugePageVector (kernels/include/cemlm/kernels/huge_pages.h): large buffers come 2 MiB-aligned
// with the kernel's huge-page advice on their mapping, small ones from the ordinary heap, and
// contents survive growth across the threshold.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "cemlm/kernels/huge_pages.h"

namespace cemlm {
namespace {

// The VmFlags of the mapping holding p (from /proc/self/smaps), or "" when none was found.
std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= addr && addr < hi;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) return line;
  }
  return "";
}

TEST(HugePageVector, LargeBuffersAlignedAndAdvised) {
  HugePageVector<float> v(size_t(3) << 20, 1.5f);  // 12 MiB
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % kHugePageBytes, 0u);
  for (size_t i = 0; i < v.size(); i += 4099) ASSERT_EQ(v[i], 1.5f);
  // Where the kernel has transparent huge pages at all, the advice is on the mapping ("hg").
  if (std::filesystem::exists("/sys/kernel/mm/transparent_hugepage/enabled")) {
    const std::string flags = vm_flags_of(v.data() + v.size() / 2);
    ASSERT_FALSE(flags.empty()) << "no mapping found for the buffer in /proc/self/smaps";
    EXPECT_NE(flags.find(" hg"), std::string::npos) << flags;
  }
}

TEST(HugePageVector, SmallBuffersAndGrowthKeepContents) {
  HugePageVector<uint16_t> v;
  for (int i = 0; i < 3 << 20; ++i) v.push_back(uint16_t(i * 7));  // grows from bytes to 6 MiB
  for (int i = 0; i < 3 << 20; i += 977) ASSERT_EQ(v[size_t(i)], uint16_t(i * 7)) << i;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % kHugePageBytes, 0u);
  HugePageVector<float> small(100, 2.0f);
  EXPECT_EQ(small[99], 2.0f);
  small.resize(size_t(1) << 20, 4.0f);  // 100 floats to 4 MiB: copied onto the large path
  EXPECT_EQ(small[99], 2.0f);
  EXPECT_EQ(small.back(), 4.0f);
}

}  // namespace
}  // namespace cemlm
