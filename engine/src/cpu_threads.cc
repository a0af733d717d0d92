// The default compute thread count: affinity mask capped by the cgroup CPU limit. Without the
// cap, a container limited to 4 CPUs on a 64-core host ran a team of 64 threads that the CFS quota
// stopped for most of every period, each step waiting at barriers for throttled threads.
#include "cemlm/engine/cpu_threads.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

extern "C" void openblas_set_num_threads(int);  // OpenBLAS's, not in the generic cblas.h

namespace cemlm {
namespace {

namespace fs = std::filesystem;

// The whole first line of `p` as numbers or words; empty when unreadable.
std::vector<std::string> words(const fs::path& p) {
  std::ifstream f(p);
  std::string line;
  if (!f || !std::getline(f, line)) return {};
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// A positive finite number, else 0.
double positive(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  return end != text.c_str() && *end == '\0' && std::isfinite(v) && v > 0 ? v : 0;
}

// cgroup v2: cpu.max holds "QUOTA PERIOD", QUOTA "max" for none.
double v2_limit(const fs::path& dir) {
  const auto w = words(dir / "cpu.max");
  if (w.size() != 2 || w[0] == "max") return 0;
  const double quota = positive(w[0]), period = positive(w[1]);
  return quota > 0 && period > 0 ? quota / period : 0;
}

// cgroup v1: cpu.cfs_quota_us (-1 for none) over cpu.cfs_period_us.
double v1_limit(const fs::path& dir) {
  const auto q = words(dir / "cpu.cfs_quota_us"), p = words(dir / "cpu.cfs_period_us");
  if (q.size() != 1 || p.size() != 1) return 0;
  const double quota = positive(q[0]), period = positive(p[0]);
  return quota > 0 && period > 0 ? quota / period : 0;
}

// The tightest limit of the group at `rel` under the hierarchy mounted at `mount`, and of its
// ancestors up to the mount. Without a cgroup namespace the path listed is the host's, which a
// container does not mount: the walk up ends at the mount, the container's own group.
double tightest(const fs::path& mount, const std::string& rel,
                const std::function<double(const fs::path&)>& limit) {
  const fs::path top = mount.lexically_normal();
  fs::path dir = (top / fs::path(rel).relative_path()).lexically_normal();
  double best = 0;
  for (;;) {
    const double l = limit(dir);
    if (l > 0 && (best == 0 || l < best)) best = l;
    if (dir == top || dir.string().size() <= top.string().size()) break;
    dir = dir.parent_path();
  }
  return best;
}

int affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

// The tightest of `v1` (on `controller`'s v1 hierarchy, mounted as one of `v1_mounts`) or `v2`
// (the unified one) over this process's group and its ancestors; 0 when none applies.
double cgroup_tightest(const std::string& cgroup_root, const std::string& self_cgroup,
                       const std::string& controller, std::initializer_list<const char*> v1_mounts,
                       const std::function<double(const fs::path&)>& v1,
                       const std::function<double(const fs::path&)>& v2) {
  std::ifstream f(self_cgroup);
  std::string v2_path;
  for (std::string line; std::getline(f, line);) {
    // "ID:CONTROLLERS:PATH"; cgroup v2's single line is "0::PATH".
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {
      v2_path = path;
      continue;
    }
    std::istringstream list(controllers);
    for (std::string c; std::getline(list, c, ',');) {
      if (c != controller) continue;
      // v1 (or a hybrid system, whose controller is on v1): mounted under its (joint) name.
      for (const char* mount : v1_mounts) {
        std::error_code ec;
        if (fs::is_directory(fs::path(cgroup_root) / mount, ec))
          return tightest(fs::path(cgroup_root) / mount, path, v1);
      }
    }
  }
  return v2_path.empty() ? 0 : tightest(cgroup_root, v2_path, v2);
}

// A finite number >= 0, else -1.
double nonnegative(const std::string& text) {
  const double v = positive(text);
  return v > 0 ? v : text == "0" ? 0 : -1;
}

// The first number after `key` on its line of `file` ("key N", "key:   N kB"), or -1.
double keyed(const fs::path& file, std::string_view key) {
  std::ifstream f(file);
  for (std::string line; std::getline(f, line);) {
    if (!line.starts_with(key) || line.size() <= key.size() ||
        !absl::ascii_isspace(static_cast<unsigned char>(line[key.size()])))
      continue;
    std::istringstream in(line.substr(key.size()));
    std::string number;
    return in >> number ? nonnegative(number) : -1;
  }
  return -1;
}

// Room left under `limit` with `used` taken, `reclaimable` of it to be given back: 0 where there
// is no limit (or it cannot be read); at least 1 byte where there is one.
double room(double limit, double used, double reclaimable) {
  if (!(limit > 0) || limit >= 0x1p62 || used < 0) return 0;
  return std::max(1.0, limit - used + std::max(0.0, reclaimable));
}

// The file pages of a memory.stat (active and inactive: the kernel takes both back before it
// ends a process; a corpus read twice sits on the active list), keys prefixed `prefix`.
double file_pages(const fs::path& stat, const std::string& prefix) {
  return std::max(0.0, keyed(stat, prefix + "active_file")) +
         std::max(0.0, keyed(stat, prefix + "inactive_file"));
}

// cgroup v2: room under memory.max ("max" for none) above memory.current, with the file pages
// of memory.stat counted as free.
double v2_memory_room(const fs::path& dir) {
  const auto max = words(dir / "memory.max"), current = words(dir / "memory.current");
  if (max.size() != 1 || current.size() != 1) return 0;
  return room(positive(max[0]), nonnegative(current[0]), file_pages(dir / "memory.stat", ""));
}

// cgroup v1: the same from memory.limit_in_bytes (a huge number for none), memory.usage_in_bytes
// and the total_ file pages.
double v1_memory_room(const fs::path& dir) {
  const auto limit = words(dir / "memory.limit_in_bytes"),
             usage = words(dir / "memory.usage_in_bytes");
  if (limit.size() != 1 || usage.size() != 1) return 0;
  return room(positive(limit[0]), nonnegative(usage[0]), file_pages(dir / "memory.stat", "total_"));
}

}  // namespace

double cgroup_cpu_limit(const std::string& cgroup_root, const std::string& self_cgroup) {
  return cgroup_tightest(cgroup_root, self_cgroup, "cpu", {"cpu,cpuacct", "cpu"}, v1_limit,
                         v2_limit);
}

int64_t available_memory_bytes(const std::string& cgroup_root, const std::string& self_cgroup,
                               const std::string& meminfo) {
  double best = -1;
  // MemAvailable: the kernel's estimate of what can be allocated without swapping.
  if (const double kib = keyed(meminfo, "MemAvailable:"); kib >= 0) best = kib * 1024;
  if (const double r = cgroup_tightest(cgroup_root, self_cgroup, "memory", {"memory"},
                                       v1_memory_room, v2_memory_room);
      r > 0 && (best < 0 || r < best))
    best = r;
  return best < 0 ? -1 : int64_t(std::min(best, 0x1p62));
}

bool memory_left_for(int64_t bytes) {
  const int64_t left = available_memory_bytes();
  return left < 0 || bytes <= left - std::min(left / 10, int64_t(256) << 20);
}

namespace {

// --threads is refused past kMaxThreads; the defaults are held to it: past the system's thread
// limit, OpenMP's thread creation fails and ends the process.
CpuThreads at_most_max(CpuThreads t) {
  if (t.threads <= kMaxThreads) return t;
  return {kMaxThreads, absl::StrCat(t.why, " (", t.threads, "), at most ", kMaxThreads)};
}

}  // namespace

std::string threads_flag_error(int threads) {
  if (threads >= 0 && threads <= kMaxThreads) return "";
  return absl::StrCat("--threads ", threads, " must be >= 0 and at most ", kMaxThreads,
                      " (0: OMP_NUM_THREADS if set, else the CPUs this process may use)");
}

CpuThreads cpu_threads(int asked) {
  if (asked > 0) return {asked, "--threads"};
  // As OpenMP reads it: a count per nesting level, each "[+]digits" above 0 between blanks.
  // One it refuses ("abc", "0", "1,abc") leaves it at its default, the CPU count: said as such,
  // and the cgroup limit below applies, not reported as OMP_NUM_THREADS.
  std::string ignored;
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env && *env) {
    const bool valid = absl::c_all_of(absl::StrSplit(env, ','), [](absl::string_view item) {
      item = absl::StripAsciiWhitespace(item);
      if (absl::ConsumePrefix(&item, "+") && item.empty()) return false;
      int n = 0;
      return !item.empty() && item.find_first_not_of("0123456789") == absl::string_view::npos &&
             absl::SimpleAtoi(item, &n) && n > 0;
    });
    if (valid) return at_most_max({omp_get_max_threads(), "OMP_NUM_THREADS"});
    ignored =
        absl::StrCat("; OMP_NUM_THREADS='", absl::CHexEscape(env), "' is no thread count, ignored");
  }
  const int cpus = affinity_cpus();
  const double limit = cgroup_cpu_limit();
  if (limit > 0 && std::ceil(limit) < cpus)
    return {int(std::ceil(limit)),
            absl::StrCat("the cgroup CPU limit ", limit, " of ", cpus, " CPUs", ignored)};
  return at_most_max({cpus, absl::StrCat(cpus, " CPUs", ignored)});
}

CpuThreads use_cpu_threads(int asked) {
  const CpuThreads t = cpu_threads(asked);
  omp_set_num_threads(t.threads);
  openblas_set_num_threads(t.threads);
  return t;
}

}  // namespace cemlm
