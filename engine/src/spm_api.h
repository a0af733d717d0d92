// The interface of the SentencePiece plugin libcemlm_spm.so. Debian's libsentencepiece exports
// its own protobuf 3.14, which clashes with the system libprotobuf 3.21 that gRPC uses (the
// process crashes at start-up), so SentencePiece is only loaded by dlopen(RTLD_LOCAL |
// RTLD_DEEPBIND) of the plugin, binding to its own protobuf and invisible to the rest. Both
// sides share one libstdc++, so standard types cross the boundary.
#pragma once
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cemlm/engine/corpus.h"

namespace cemlm {

struct SpmApi {
  // A SentencePieceProcessor from a serialized model; null with *error (SentencePiece's reason).
  void* (*load)(const std::string& serialized, std::string* error);
  void (*destroy)(void* sp);
  // False with *error (SentencePiece's reason) when the model cannot encode the text.
  bool (*encode)(const void* sp, std::string_view text, std::vector<int>* ids, std::string* error);
  bool (*decode)(const void* sp, const std::vector<int>& ids, std::string* text);
  std::string (*id_to_piece)(const void* sp, int id);
  int (*piece_size)(const void* sp);
  int (*bos_id)(const void* sp);
  int (*eos_id)(const void* sp);
  int (*unk_id)(const void* sp);
  int (*pad_id)(const void* sp);
  // Trains on every non-empty line of `corpus`; the serialized model in *model, or *error.
  bool (*train)(const std::unordered_map<std::string, std::string>& args,
                const std::vector<TextFile>& corpus, unsigned seed, std::string* model,
                std::string* error);
};

}  // namespace cemlm

// The plugin's one exported symbol.
extern "C" const cemlm::SpmApi* cemlm_spm_api();
