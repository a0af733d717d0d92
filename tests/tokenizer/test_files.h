// Shared by the tokenizer tests: a fresh temporary directory per test, small file writers, and
// the Debian fortunes files the tokenizer is trained on (installed by the setup).
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "temp_dir.h"

namespace cemlm::testing_files {

inline const std::string kFortunes = "/usr/share/games/fortunes";

// An empty directory unique to the running test (or suite), removed when it is done with.
inline std::string fresh_temp_dir() { return testing_temp::fresh_dir("tokenizer"); }

inline void write_file(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << bytes;
}

// Two small fortunes files (~40 KB): enough text to train a few-hundred-piece tokenizer quickly.
inline std::vector<std::string> small_corpus() {
  return {kFortunes + "/fortunes", kFortunes + "/debian"};
}

// A serialized SentencePiece model with normalizer_spec.add_dummy_prefix turned on, as spm_train
// leaves it by default (`cemlm tokenizer train` writes it off), and remove_extra_whitespaces too
// when `extra_whitespaces_removed` (spm_train's default as well: decode then drops every "▁"
// before a text's first text, not only the first): the ModelProto's field 3 holds the
// NormalizerSpec, whose fields 3 and 4 are those bools. Fails the test when a field is not there.
inline std::string with_dummy_prefix(std::string model, bool extra_whitespaces_removed = false) {
  size_t at = 0;
  auto varint = [&](size_t end) {
    uint64_t v = 0;
    for (int shift = 0; at < end; shift += 7) {
      const auto byte = uint8_t(model[at++]);
      v |= uint64_t(byte & 0x7F) << shift;
      if (!(byte & 0x80)) break;
    }
    return v;
  };
  auto skip = [&](uint64_t tag, size_t end) {
    switch (tag & 7) {
      case 0: varint(end); break;
      case 1: at += 8; break;
      case 2: at += varint(end); break;
      case 5: at += 4; break;
      default: ADD_FAILURE() << "unexpected wire type " << (tag & 7); at = end;
    }
  };
  while (at < model.size()) {
    const uint64_t tag = varint(model.size());
    if (tag != ((3 << 3) | 2)) {
      skip(tag, model.size());
      continue;
    }
    const size_t end = at + varint(model.size());
    int turned_on = 0;
    while (at < end) {
      const uint64_t field = varint(end);
      if ((field == (3 << 3) || (extra_whitespaces_removed && field == (4 << 3))) && at < end &&
          model[at] == 0) {
        model[at] = 1;
        ++turned_on;
      }
      skip(field, end);
    }
    if (turned_on == (extra_whitespaces_removed ? 2 : 1)) return model;
    break;
  }
  ADD_FAILURE() << "no normalizer_spec.add_dummy_prefix (or remove_extra_whitespaces) = false in "
                   "the model";
  return model;
}

}  // namespace cemlm::testing_files
