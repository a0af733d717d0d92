// libcemlm_spm.so: SentencePiece behind the SpmApi table (see src/spm_api.h for why it is a
// plugin). The only file that includes SentencePiece; its header defines its own
// absl::string_view, so nothing here may include an abseil or gRPC header.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <string>

#include "spm_api.h"

namespace cemlm {
namespace {

using sentencepiece::SentencePieceProcessor;

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

void* load(const std::string& serialized, std::string* error) {
  auto sp = std::make_unique<SentencePieceProcessor>();
  if (auto st = sp->LoadFromSerializedProto(serialized); !st.ok()) {
    *error = detail(st);
    return nullptr;
  }
  return sp.release();
}

bool train(const std::unordered_map<std::string, std::string>& args,
           const std::vector<TextFile>& corpus, unsigned seed, std::string* model,
           std::string* error) {
  sentencepiece::SetRandomGeneratorSeed(seed);
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
    [](const void* sp, std::string_view text, std::vector<int>* ids) {
      return proc(sp).Encode(text, ids).ok();
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
