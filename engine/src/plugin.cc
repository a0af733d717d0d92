// Plugin search and loading (see plugin.h).
#include "cemlm/engine/plugin.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

namespace cemlm {

void* load_plugin_entry(const char* file_name, const char* env_var, const char* build_path,
                        const char* entry, bool deep_bind, std::string* error) {
  namespace fs = std::filesystem;
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_var); env && *env) candidates.push_back(env);
  std::error_code ec;
  if (fs::path exe = fs::read_symlink("/proc/self/exe", ec); !ec) {
    candidates.push_back((exe.parent_path() / file_name).string());
    candidates.push_back((exe.parent_path().parent_path() / "lib" / file_name).string());
  }
  if (build_path && *build_path) candidates.push_back(build_path);
  candidates.push_back(file_name);
  std::string failure = "not found";
  for (const std::string& path : candidates) {
    if (path.find('/') != std::string::npos && !fs::exists(path, ec)) continue;
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | (deep_bind ? RTLD_DEEPBIND : 0));
    if (void* fn = lib ? dlsym(lib, entry) : nullptr) return fn;
    const char* why = dlerror();
    failure = why ? why : path + ": no " + entry;
  }
  if (error) *error = failure;
  return nullptr;
}

}  // namespace cemlm
