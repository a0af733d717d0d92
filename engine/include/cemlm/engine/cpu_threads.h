// How many compute threads a CPU run uses when --threads is not given: the CPUs this process
// may run on (its affinity mask), capped by a cgroup CPU limit (a container's --cpus, a pod's
// limits.cpu, systemd's CPUQuota), as OMP_NUM_THREADS would otherwise be the only way to say so.
// And how much memory it may still take, under the same kind of limits.
#pragma once
#include <cstdint>
#include <string>

namespace cemlm {

struct CpuThreads {
  int threads = 1;
  std::string why;  // for the log: "--threads", "OMP_NUM_THREADS", "the cgroup CPU limit 2.5 of 16 CPUs", ...
};

// The most --threads a program takes: more than the CPUs of any machine it runs on, and far below
// the system's thread limit, past which OpenMP's thread creation fails (serve crashed, generate
// ended in libgomp's "Thread creation failed" naming no flag).
inline constexpr int kMaxThreads = 1024;

// The help of the programs' --threads flag.
inline constexpr const char* kThreadsHelp =
    "CPU compute threads, at most 1024; 0 = OMP_NUM_THREADS if set, else the CPUs this process "
    "may use (affinity mask, capped by a container's or cgroup's CPU limit)";

// "" when `threads` is a --threads value the programs take (0 to kMaxThreads), else the error.
std::string threads_flag_error(int threads);

// `asked` > 0 is taken as given; 0 means: OMP_NUM_THREADS if set, else the CPUs of the affinity
// mask capped by the cgroup limit rounded up; either default at most kMaxThreads.
CpuThreads cpu_threads(int asked);

// cpu_threads(asked), made OpenBLAS's count and OpenMP's for the calling thread (a per-thread
// setting: a thread of its own that computes sets it again).
CpuThreads use_cpu_threads(int asked);

// The tightest CPU limit of this process's cgroup and its ancestors, in CPUs (quota / period);
// 0 when there is none or it cannot be read. Reads cgroup v2's cpu.max, else v1's
// cpu.cfs_quota_us / cpu.cfs_period_us. The paths are parameters for tests.
double cgroup_cpu_limit(const std::string& cgroup_root = "/sys/fs/cgroup",
                        const std::string& self_cgroup = "/proc/self/cgroup");

// The bytes this process may still take before the kernel's (or its cgroup's) out-of-memory
// killer ends something: /proc/meminfo's MemAvailable, capped by the room left under the
// tightest cgroup memory limit of its group and their ancestors (v2 memory.max less
// memory.current, or v1's limit_in_bytes less usage_in_bytes; their file pages, which the
// kernel takes back before it kills, counted as free); -1 when neither can be read. The paths are
// parameters for tests.
int64_t available_memory_bytes(const std::string& cgroup_root = "/sys/fs/cgroup",
                               const std::string& self_cgroup = "/proc/self/cgroup",
                               const std::string& meminfo = "/proc/meminfo");
// Whether `bytes` more can be taken leaving a margin (a tenth of what is left, at most 256 MiB)
// to the rest of the process and the machine; true when available_memory_bytes cannot tell.
bool memory_left_for(int64_t bytes);

}  // namespace cemlm
