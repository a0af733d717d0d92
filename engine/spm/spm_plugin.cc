// libcemlm_spm.so: SentencePiece behind the SpmApi table (see src/spm_api.h for why it is a
// plugin). The only file that includes SentencePiece; its header defines its own
// absl::string_view, so nothing here may include an abseil or gRPC header.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>

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

// Feeds the corpus to the trainer one non-empty line at a time, without copying it.
class CorpusLines final : public sentencepiece::SentenceIterator {
 public:
  explicit CorpusLines(const std::vector<TextFile>& files) : files_(files) { Next(); }
  bool done() const override { return file_ >= files_.size(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }
  void Next() override {
    for (; file_ < files_.size(); ++file_, pos_ = 0) {
      const std::string& text = files_[file_].text;
      while (pos_ < text.size()) {
        size_t end = std::min(text.find('\n', pos_), text.size());
        line_.assign(text, pos_, end - pos_);
        pos_ = end + 1;
        if (line_.ends_with('\r')) line_.pop_back();
        if (!line_.empty()) return;
      }
    }
  }

 private:
  const std::vector<TextFile>& files_;
  size_t file_ = 0, pos_ = 0;
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
  CorpusLines lines(corpus);
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
