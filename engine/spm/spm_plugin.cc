// libcemlm_spm.so: SentencePiece behind the SpmApi table (see src/spm_api.h for why it is a
// plugin). The only file that includes SentencePiece; its header defines its own
// absl::string_view, so nothing here may include an abseil or gRPC header.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "spm_api.h"

// SentencePiece's log threshold (not in its installed headers): weak, so that a build of it
// without them still loads the plugin, which then leaves its logging as it is.
namespace sentencepiece::logging {
[[gnu::weak]] int GetMinLogLevel();
[[gnu::weak]] void SetMinLogLevel(int v);
}  // namespace sentencepiece::logging

namespace cemlm {
namespace {

using sentencepiece::SentencePieceProcessor;

// SentencePiece's log level is one process-wide int: a load quiets it for its span, and a
// training sets it from its arguments; one at a time, or one would undo the other's.
std::mutex g_log_level_mu;

const SentencePieceProcessor& proc(const void* sp) {
  return *static_cast<const SentencePieceProcessor*>(sp);
}

// SentencePiece messages read "./src/x.cc(12) [condition] detail"; users need only the detail.
std::string detail(const sentencepiece::util::Status& st) {
  std::string msg = st.error_message();
  if (size_t cut = msg.find("] "); msg.starts_with("./") && cut != std::string::npos)
    msg = msg.substr(cut + 2);
  return msg;
}

// Where the sentence starting at `pos` of the line text[pos, end) ends: at `end` when it fits in
// `max` bytes, else before the last space within them (the words stay whole, and the space starts
// the next sentence as it starts a piece), else at the last character boundary.
size_t sentence_end(const std::string& text, size_t pos, size_t end, size_t max) {
  if (end - pos <= max) return end;
  if (size_t space = text.rfind(' ', pos + max); space != std::string::npos && space > pos)
    return space;
  size_t cut = pos + max;
  while (cut > pos + 1 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return cut;
}

// Feeds the corpus to the trainer one non-empty line at a time, without copying it. SentencePiece
// skips a sentence longer than its max_sentence_length (silently, and training fails without a
// reason when none is left), so a longer line is fed as several sentences of at most `max` bytes.
class CorpusLines final : public sentencepiece::SentenceIterator {
 public:
  CorpusLines(const std::vector<TextFile>& files, size_t max) : files_(files), max_(max) { Next(); }
  bool done() const override { return file_ >= files_.size(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }
  void Next() override {
    for (; file_ < files_.size(); ++file_, pos_ = end_ = 0) {
      const std::string& text = files_[file_].text;
      while (pos_ < text.size()) {
        if (pos_ >= end_) {  // the next line: [pos_, end_) without its "\n" or "\r\n"
          const size_t newline = std::min(text.find('\n', pos_), text.size());
          end_ = newline > pos_ && text[newline - 1] == '\r' ? newline - 1 : newline;
          if (end_ == pos_) {  // empty
            pos_ = newline + 1;
            continue;
          }
        }
        const size_t cut = sentence_end(text, pos_, end_, max_);
        line_.assign(text, pos_, cut - pos_);
        pos_ = cut == end_ ? std::min(text.find('\n', end_), text.size()) + 1 : cut;
        return;
      }
    }
  }

 private:
  const std::vector<TextFile>& files_;
  const size_t max_;
  size_t file_ = 0, pos_ = 0, end_ = 0;
  std::string line_;
};

// SentencePiece trusts a model's precompiled_charsmap: its Normalizer walks the double-array trie
// in it and indexes the replacement strings after it without a bounds check, so a damaged
// charsmap made encode (decode, for the denormalizer's) read out of bounds and crash. The checks
// below cover every read that a search for any input can make. Layout: a u32 trie size in bytes,
// the trie (darts-clone units), then the NUL-terminated replacements that its values index.
namespace charsmap {

// darts-clone's unit fields (darts.h, DoubleArrayUnit).
bool has_leaf(uint32_t u) { return (u >> 8) & 1; }
uint32_t value(uint32_t u) { return u & 0x7FFFFFFF; }
uint32_t label(uint32_t u) { return u & 0x800000FF; }
uint32_t offset(uint32_t u) { return (u >> 10) << ((u & (1U << 9)) >> 6); }

// SentencePiece keeps the matches of one search in an array of this many (kMaxTrieResultsSize)
// but reads back as many as the trie reports.
constexpr int kMaxMatches = 32;

// Empty when searches in `blob` stay in bounds, else what is wrong.
std::string check(std::string_view blob) {
  uint32_t trie_bytes = 0;
  if (blob.size() >= 4) std::memcpy(&trie_bytes, blob.data(), 4);
  if (blob.size() < 4 || trie_bytes < 4 || trie_bytes > blob.size() - 4)
    return "its trie size does not fit the " + std::to_string(blob.size()) + " bytes";
  std::vector<uint32_t> units(trie_bytes / 4);
  std::memcpy(units.data(), blob.data() + 4, units.size() * 4);
  const std::string_view strings = blob.substr(4 + trie_bytes);
  const uint64_t n = units.size();
  // A search at node base `s` reads the unit at s ^ byte for the input's next byte.
  auto in_bounds = [n](uint32_t s) { return (uint64_t(s) | 0xFF) < n; };
  auto value_ok = [&](uint32_t u) {
    return value(u) < strings.size() && strings.find('\0', value(u)) != std::string_view::npos;
  };
  // Depth-first over the node bases a search can reach, with the most matches on a path below
  // each; a base reached again while below itself is a loop, which no trie has.
  enum : uint8_t { kNew, kOpen, kDone };
  std::vector<uint8_t> state(n, kNew);
  std::vector<int> matches_below(n, 0);
  struct Frame {
    uint32_t base;
    uint32_t next_byte = 0;
    int best = 0, edge = 0;  // most matches below; whether the edge being followed matches
  };
  const uint32_t root = offset(units[0]);
  if (!in_bounds(root)) return "its root points outside the trie";
  std::vector<Frame> stack{{root}};
  state[root] = kOpen;
  while (!stack.empty()) {
    Frame& f = stack.back();
    if (f.next_byte == 256) {
      const uint32_t done = f.base;
      state[done] = kDone;
      matches_below[done] = f.best;
      stack.pop_back();
      if (!stack.empty())
        stack.back().best = std::max(stack.back().best, stack.back().edge + matches_below[done]);
      continue;
    }
    const uint32_t byte = f.next_byte++, at = f.base ^ byte;
    if (label(units[at]) != byte) continue;
    const uint32_t child = at ^ offset(units[at]);
    if (!in_bounds(child)) return "a node points outside the trie";
    const int edge = has_leaf(units[at]);
    if (edge && !value_ok(units[child]))
      return "a replacement lies outside its " + std::to_string(strings.size()) + " bytes";
    if (state[child] == kOpen) return "its trie loops";
    if (state[child] == kDone) {
      f.best = std::max(f.best, edge + matches_below[child]);
      continue;
    }
    f.edge = edge;
    state[child] = kOpen;
    stack.push_back({child});
  }
  if (matches_below[root] > kMaxMatches)
    return "an input matches " + std::to_string(matches_below[root]) + " of its rules, more than " +
           std::to_string(kMaxMatches);
  return "";
}

// The payloads of the length-delimited fields numbered `field` of the serialized message `msg`;
// false when it holds a group (which no SentencePiece message has) or cannot be walked.
bool fields(std::string_view msg, uint64_t field, std::vector<std::string_view>* out) {
  size_t at = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; at < msg.size() && shift < 64; shift += 7) {
      const auto byte = uint8_t(msg[at++]);
      *v |= uint64_t(byte & 0x7F) << shift;
      if (!(byte & 0x80)) return true;
    }
    return false;
  };
  while (at < msg.size()) {
    uint64_t tag = 0, size = 0;
    if (!varint(&tag)) return false;
    const uint64_t wire = tag & 7;
    if (wire == 0 || wire == 2) {
      if (!varint(&size)) return false;
      if (wire == 0) continue;
    } else if (wire == 1 || wire == 5) {
      size = wire == 1 ? 8 : 4;
    } else {
      return false;
    }
    if (size > msg.size() - at) return false;
    if (wire == 2 && tag >> 3 == field) out->push_back(msg.substr(at, size));
    at += size;
  }
  return true;
}

// Empty when the normalizer's and denormalizer's charsmaps (ModelProto fields 3 and 5, their
// field 2) are safe, else which is not and why.
std::string check_model(std::string_view model) {
  for (const auto& [spec_field, spec_name] :
       {std::pair<uint64_t, std::string>{3, "normalizer_spec"}, {5, "denormalizer_spec"}}) {
    std::vector<std::string_view> specs, maps;
    bool walked = fields(model, spec_field, &specs);
    for (std::string_view spec : specs) walked = walked && fields(spec, 2, &maps);
    if (!walked)
      return "its protobuf encoding is broken or holds groups (no SentencePiece model has)";
    for (std::string_view map : maps)
      if (std::string why = map.empty() ? "" : check(map); !why.empty())
        return spec_name + ".precompiled_charsmap is damaged: " + why;
  }
  return "";
}

}  // namespace charsmap

void* load(const std::string& serialized, std::string* error) {
  // Its load encodes the model's self_test_data samples (ModelProto field 4) with ~250 bytes of
  // memory a byte of them: a file near the size bound asked for 64 GB before its error. The
  // samples spm_train writes are a few short sentences.
  constexpr size_t kMaxSelfTestBytes = 256 << 10;
  std::vector<std::string_view> self_tests;
  if (!charsmap::fields(serialized, 4, &self_tests)) {
    *error = "its protobuf encoding is broken or holds groups (no SentencePiece model has)";
    return nullptr;
  }
  size_t self_test_bytes = 0;
  for (std::string_view t : self_tests) self_test_bytes += t.size();
  if (self_test_bytes > kMaxSelfTestBytes) {
    *error = "its self_test_data holds " + std::to_string(self_test_bytes) + " bytes, more than " +
             std::to_string(kMaxSelfTestBytes) +
             " (spm_train writes a few short sentences): the file is damaged, or was written by "
             "another tool";
    return nullptr;
  }
  // Checked before SentencePiece loads it: its load encodes the model's self_test_data samples,
  // so a damaged charsmap was already walked by then. Every charsmap given is checked (a field
  // given twice is merged, the last bytes winning), so the one SentencePiece keeps is too.
  if (std::string why = charsmap::check_model(serialized); !why.empty()) {
    *error = why;
    return nullptr;
  }
  auto sp = std::make_unique<SentencePieceProcessor>();
  // Building its piece index, SentencePiece throws where it has no status to return (a unigram
  // piece starting with a NUL byte: "failed to insert key: zero-length key"), which would end
  // the process.
  // A failed self-test logs the model's sample texts raw (terminal escapes, line ends) at INFO;
  // the error says what failed.
  namespace logging = sentencepiece::logging;
  std::lock_guard log_level(g_log_level_mu);
  const bool quiet = &logging::GetMinLogLevel != nullptr && &logging::SetMinLogLevel != nullptr;
  const int was = quiet ? logging::GetMinLogLevel() : 0;
  if (quiet) logging::SetMinLogLevel(std::max(was, 2));  // ERROR and worse
  struct Restore {
    bool quiet;
    int was;
    ~Restore() {
      if (quiet) sentencepiece::logging::SetMinLogLevel(was);
    }
  } restore{quiet, was};
  try {
    if (auto st = sp->LoadFromSerializedProto(serialized); !st.ok()) {
      *error = detail(st);
      // "Self-test failures. See LOG(INFO).": that log is off, and says what this does.
      if (error->starts_with("Self-test failures"))
        *error =
            "its self_test_data samples do not encode to the pieces it gives for them: the "
            "file is damaged, or was written by another SentencePiece";
      return nullptr;
    }
  } catch (const std::exception& e) {
    const std::string what = e.what();  // "./third_party/darts_clone/darts.h:1143: exception: ..."
    const size_t cut = what.find("exception: ");
    *error = "SentencePiece cannot index its pieces: " +
             (cut == std::string::npos ? what : what.substr(cut + 11));
    return nullptr;
  }
  return sp.release();
}

bool train(const std::unordered_map<std::string, std::string>& args,
           const std::vector<TextFile>& corpus, unsigned seed, std::string* model,
           std::string* error) {
  sentencepiece::SetRandomGeneratorSeed(seed);
  std::lock_guard log_level(g_log_level_mu);  // its minloglevel argument sets the same level
  CorpusLines lines(corpus, std::stoul(args.at("max_sentence_length")));
  if (auto st = sentencepiece::SentencePieceTrainer::Train(args, &lines, model); !st.ok()) {
    *error = detail(st);
    return false;
  }
  return true;
}

const SpmApi kApi = {
    load,
    [](void* sp) { delete static_cast<SentencePieceProcessor*>(sp); },
    [](const void* sp, std::string_view text, std::vector<int>* ids, std::string* error) {
      const sentencepiece::util::Status st = proc(sp).Encode(text, ids);
      if (!st.ok()) *error = detail(st);
      return st.ok();
    },
    [](const void* sp, const std::vector<int>& ids, std::string* text) {
      return proc(sp).Decode(ids, text).ok();
    },
    [](const void* sp, int id) { return proc(sp).IdToPiece(id); },
    [](const void* sp) { return proc(sp).GetPieceSize(); },
    [](const void* sp) { return proc(sp).bos_id(); },
    [](const void* sp) { return proc(sp).eos_id(); },
    [](const void* sp) { return proc(sp).unk_id(); },
    [](const void* sp) { return proc(sp).pad_id(); },
    train,
};

}  // namespace
}  // namespace cemlm

extern "C" __attribute__((visibility("default"))) const cemlm::SpmApi* cemlm_spm_api() {
  return &cemlm::kApi;
}
