// Finding and loading the engine's optional shared-object plugins (SentencePiece, the CUDA
// runner), which are kept out of the main program so that their libraries are loaded only
// when used and their symbols stay private to them.
#pragma once
#include <string>

namespace cemlm {

// dlopen()s `file_name` from, in order: $`env_var`, beside the program, ../lib of the program,
// `build_path` (the build tree; may be empty), then the library search path; and returns
// dlsym(`entry`). Null with *error (the last loader error) when no candidate provides it.
void* load_plugin_entry(const char* file_name, const char* env_var, const char* build_path,
                        const char* entry, bool deep_bind, std::string* error);

}  // namespace cemlm
