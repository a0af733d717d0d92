// The default thread count's cgroup CPU limit, read from fake cgroup trees (v2 nested groups, a
// container without a cgroup namespace, v1), and the count it gives.
#include "cemlm/engine/cpu_threads.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "temp_dir.h"

namespace cemlm {
namespace {

namespace fs = std::filesystem;

class CgroupLimit : public ::testing::Test {
 protected:
  void SetUp() override { root_ = testing_temp::fresh_dir("cgroup"); }
  // Writes `text` (a line) to ROOT/sys/REL.
  void put(const std::string& rel, const std::string& text) {
    const fs::path p = fs::path(root_) / "sys" / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text << "\n";
  }
  double limit(const std::string& self_cgroup) {
    put("../self_cgroup", self_cgroup);
    return cgroup_cpu_limit(root_ + "/sys", root_ + "/self_cgroup");
  }
  std::string root_;
};

TEST_F(CgroupLimit, V2NamespacedGroup) {
  put("cpu.max", "250000 100000");
  EXPECT_DOUBLE_EQ(limit("0::/"), 2.5);
}

TEST_F(CgroupLimit, V2TakesTheTightestOfTheGroupAndItsAncestors) {
  put("cpu.max", "max 100000");
  put("a/cpu.max", "200000 100000");
  put("a/b/cpu.max", "max 100000");
  EXPECT_DOUBLE_EQ(limit("0::/a/b"), 2.0);
  put("a/b/cpu.max", "50000 100000");
  EXPECT_DOUBLE_EQ(limit("0::/a/b"), 0.5);
}

TEST_F(CgroupLimit, V2HostPathNotMountedReadsTheMount) {
  put("cpu.max", "300000 100000");
  EXPECT_DOUBLE_EQ(limit("0::/system.slice/docker-abc.scope"), 3.0);
}

TEST_F(CgroupLimit, NoLimitOrUnreadableIsZero) {
  EXPECT_EQ(limit("0::/"), 0);  // no cpu.max at all (a host's root group)
  for (const char* text : {"max 100000", "abc 100000", "0 100000", "100000 0", "100000", "",
                           "100000 100000 7", "-5 100000", "inf 1"}) {
    put("cpu.max", text);
    EXPECT_EQ(limit("0::/"), 0) << "'" << text << "'";
  }
  EXPECT_EQ(cgroup_cpu_limit(root_ + "/sys", root_ + "/no_such_file"), 0);
}

TEST_F(CgroupLimit, V1CpuController) {
  put("cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us", "150000");
  put("cpu,cpuacct/kubepods/pod1/cpu.cfs_period_us", "100000");
  put("cpu,cpuacct/kubepods/cpu.cfs_quota_us", "-1");
  put("cpu,cpuacct/kubepods/cpu.cfs_period_us", "100000");
  const std::string self = "12:memory:/kubepods/pod1\n4:cpu,cpuacct:/kubepods/pod1\n0::/\n";
  EXPECT_DOUBLE_EQ(limit(self), 1.5);
  put("cpu,cpuacct/kubepods/pod1/cpu.cfs_quota_us", "-1");
  EXPECT_EQ(limit(self), 0);
}

// The memory left: MemAvailable, capped by the room under the tightest cgroup memory limit, where
// the file pages, active and inactive, count as free (the kernel takes them back first).
class MemoryLeft : public CgroupLimit {
 protected:
  int64_t available(const std::string& self_cgroup, const std::string& meminfo) {
    put("../self_cgroup", self_cgroup);
    put("../meminfo", meminfo);
    return available_memory_bytes(root_ + "/sys", root_ + "/self_cgroup", root_ + "/meminfo");
  }
  static constexpr int64_t kGiB = int64_t(1) << 30;
  const std::string meminfo_ =
      "MemTotal:       24000000 kB\nMemFree:         1000000 kB\n"
      "MemAvailable:   20971520 kB\nBuffers:            1000 kB";
};

TEST_F(MemoryLeft, MemAvailableWithoutALimit) {
  EXPECT_EQ(available("0::/", meminfo_), 20 * kGiB);
  put("memory.max", "max");
  put("memory.current", "123456");
  EXPECT_EQ(available("0::/", meminfo_), 20 * kGiB);
  EXPECT_EQ(available("0::/", "MemTotal: 1 kB"), -1);  // nothing readable
}

TEST_F(MemoryLeft, V2TightestRoomWithInactiveFilePagesFree) {
  put("memory.max", "max");
  put("a/memory.max", std::to_string(8 * kGiB));
  put("a/memory.current", std::to_string(6 * kGiB));
  put("a/memory.stat", "anon 100\ninactive_file " + std::to_string(kGiB) + "\nactive_file " +
                           std::to_string(kGiB) + "\nactive_anon 7");
  put("a/b/memory.max", std::to_string(16 * kGiB));
  put("a/b/memory.current", std::to_string(kGiB));
  EXPECT_EQ(available("0::/a/b", meminfo_), 4 * kGiB);  // a's 8 − 6 + 1 + 1
  // A group at its limit has almost no room, not "no limit".
  put("a/b/memory.max", std::to_string(kGiB));
  EXPECT_EQ(available("0::/a/b", meminfo_), 1);
  // A room larger than MemAvailable leaves MemAvailable.
  put("a/b/memory.max", "max");
  put("a/memory.max", std::to_string(64 * kGiB));
  EXPECT_EQ(available("0::/a/b", meminfo_), 20 * kGiB);
  // Only the cgroup's: without /proc/meminfo.
  EXPECT_EQ(available("0::/a/b", "nothing"), 60 * kGiB);
}

TEST_F(MemoryLeft, V1MemoryController) {
  put("memory/kubepods/pod1/memory.limit_in_bytes", std::to_string(4 * kGiB));
  put("memory/kubepods/pod1/memory.usage_in_bytes", std::to_string(3 * kGiB));
  put("memory/kubepods/pod1/memory.stat", "cache 7\ninactive_file 9\ntotal_inactive_file " +
                                              std::to_string(kGiB) + "\ntotal_active_file " +
                                              std::to_string(kGiB / 2));
  put("memory/kubepods/memory.limit_in_bytes", "9223372036854771712");  // v1's "none"
  put("memory/kubepods/memory.usage_in_bytes", std::to_string(5 * kGiB));
  const std::string self = "12:memory:/kubepods/pod1\n4:cpu,cpuacct:/kubepods/pod1\n0::/\n";
  EXPECT_EQ(available(self, meminfo_), 2 * kGiB + kGiB / 2);  // 4 − 3 + 1 + 0.5
}

TEST(CpuThreads, AskedIsTakenAsGiven) {
  const CpuThreads t = cpu_threads(3);
  EXPECT_EQ(t.threads, 3);
  EXPECT_EQ(t.why, "--threads");
}

// The programs check --threads against kMaxThreads; their help says the bound.
TEST(CpuThreads, HelpSaysTheMostThreads) {
  EXPECT_NE(std::string(kThreadsHelp).find("at most " + std::to_string(kMaxThreads) + ";"),
            std::string::npos)
      << kThreadsHelp;
}

TEST(CpuThreads, DefaultIsTheAffinityMaskCappedByTheLimit) {
  if (std::getenv("OMP_NUM_THREADS")) GTEST_SKIP() << "OMP_NUM_THREADS decides here";
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(sched_getaffinity(0, sizeof set, &set), 0);
  const int cpus = CPU_COUNT(&set);
  const double limit = cgroup_cpu_limit();
  const CpuThreads t = cpu_threads(0);
  EXPECT_EQ(t.threads, limit > 0 && std::ceil(limit) < cpus ? int(std::ceil(limit)) : cpus) << t.why;
  EXPECT_NE(t.why.find("CPUs"), std::string::npos) << t.why;
}

// OMP_NUM_THREADS that OpenMP refuses leaves it at its default: said to be ignored, and the CPU
// count (under the cgroup limit) is the count, not reported as OMP_NUM_THREADS's.
TEST(CpuThreads, AnOmpNumThreadsOpenMpRefusesIsSaidToBeIgnored) {
  const char* was = std::getenv("OMP_NUM_THREADS");
  const std::string saved = was ? was : "";
  for (const char* bad : {"abc", "0", "-2", "4x", ",3", "1,abc", "2,0", "+"}) {
    ::setenv("OMP_NUM_THREADS", bad, 1);
    const CpuThreads t = cpu_threads(0);
    EXPECT_NE(t.why.find(std::string("OMP_NUM_THREADS='") + bad + "' is no thread count, ignored"),
              std::string::npos)
        << bad << ": " << t.why;
    EXPECT_NE(t.why.find("CPUs"), std::string::npos) << t.why;
  }
  for (const char* good : {"3", " 3 ", "2,1", "+1", "4, 2"}) {
    ::setenv("OMP_NUM_THREADS", good, 1);
    EXPECT_EQ(cpu_threads(0).why, "OMP_NUM_THREADS") << good;
  }
  if (was)
    ::setenv("OMP_NUM_THREADS", saved.c_str(), 1);
  else
    ::unsetenv("OMP_NUM_THREADS");
}

}  // namespace
}  // namespace cemlm
