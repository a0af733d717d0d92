// SentencePiece behind Tokenizer, the incremental detokenizer and tokenizer training (see
// tokenizer.h). The only file that includes SentencePiece: its header defines its own
// absl::string_view, so nothing here may include an abseil or gRPC header.
#include "cemlm/engine/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <thread>
#include <unordered_map>

#include "cemlm/engine/corpus.h"
#include "cemlm/kernels/tensor.h"  // CEMLM_CHECK

namespace cemlm {
namespace {

namespace fs = std::filesystem;

constexpr int kSpecialIds = 4;  // unk, bos, eos, pad
constexpr int kByteIds = 256;   // byte fallback: one piece per byte value
constexpr unsigned kTrainSeed = 20240229;
constexpr char kReplacementChar[] = "\xEF\xBF\xBD";  // U+FFFD: what decode makes of partial bytes

// SentencePiece messages read "./src/x.cc(12) [condition] detail"; users need only the detail.
std::string detail(const sentencepiece::util::Status& st) {
  std::string msg = st.error_message();
  if (size_t cut = msg.find("] "); msg.starts_with("./") && cut != std::string::npos)
    msg = msg.substr(cut + 2);
  return msg;
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<sentencepiece::SentencePieceProcessor> sp)
    : sp_(std::move(sp)) {}
Tokenizer::~Tokenizer() = default;

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path, std::string* error) {
  std::string bytes;
  if (!read_file(path, &bytes, error)) {
    *error = "cannot load tokenizer: " + *error;
    return nullptr;
  }
  auto sp = std::make_unique<sentencepiece::SentencePieceProcessor>();
  if (auto st = sp->LoadFromSerializedProto(bytes); !st.ok()) {
    std::string why = detail(st);
    *error = "tokenizer '" + path + "' is not a SentencePiece model" +
             (why.empty() ? "" : " (" + why + ")") + "; pass a .model file written by " +
             "`cemlm tokenizer train` or spm_train";
    return nullptr;
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(sp)));
}

std::vector<int> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto st = sp_->Encode(text, &ids);
  CEMLM_CHECK(st.ok());  // only fails when no model is loaded
  return ids;
}

std::string Tokenizer::decode(std::span<const int> ids) const {
  std::vector<int> known(ids.begin(), ids.end());
  for (int& id : known)
    if (id < 0 || id >= vocab_size()) id = unk_id();
  std::string text;
  const auto st = sp_->Decode(known, &text);
  CEMLM_CHECK(st.ok());  // every id is in range now
  return text;
}

std::string Tokenizer::id_to_piece(int id) const {
  // SentencePiece aborts on an out-of-range id instead of reporting it.
  return id >= 0 && id < vocab_size() ? sp_->IdToPiece(id) : std::string();
}

int Tokenizer::vocab_size() const { return sp_->GetPieceSize(); }
int Tokenizer::bos_id() const { return sp_->bos_id(); }
int Tokenizer::eos_id() const { return sp_->eos_id(); }
int Tokenizer::unk_id() const { return sp_->unk_id(); }
int Tokenizer::pad_id() const { return sp_->pad_id(); }

std::string IncrementalDetokenizer::next(std::span<const int> ids) { return emit(ids, false); }
std::string IncrementalDetokenizer::finish(std::span<const int> ids) { return emit(ids, true); }

std::string IncrementalDetokenizer::emit(std::span<const int> ids, bool final) {
  CEMLM_CHECK(ids.size() >= read_offset_);
  const std::string context =
      tokenizer_->decode(ids.subspan(prefix_offset_, read_offset_ - prefix_offset_));
  const std::string text = tokenizer_->decode(ids.subspan(prefix_offset_));
  // A trailing U+FFFD is usually a character whose remaining bytes are still to come.
  if (text.size() <= context.size() || (!final && text.ends_with(kReplacementChar))) return "";
  prefix_offset_ = read_offset_;
  read_offset_ = ids.size();
  return text.substr(context.size());
}

namespace {

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

std::unordered_map<std::string, std::string> trainer_args(const TokenizerTrainOptions& opts) {
  return {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(opts.vocab_size)},
      {"byte_fallback", "true"},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "3"},
      // Exact round trips: no Unicode normalization, whitespace kept as written, and no dummy
      // leading space (so a streamed continuation's first "▁" decodes to its space).
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},
      {"add_dummy_prefix", "false"},
      {"allow_whitespace_only_pieces", "true"},
      // Bounds memory on big corpora; the seeded shuffle keeps the sample deterministic.
      {"input_sentence_size", "2000000"},
      {"shuffle_input_sentence", "true"},
      {"max_sentence_length", "65536"},
      {"num_threads", std::to_string(std::max(1u, std::thread::hardware_concurrency()))},
      {"minloglevel", opts.verbose ? "0" : "2"},
  };
}

bool write_atomically(const std::string& path, const std::string& bytes, std::string* error) {
  std::error_code ec;
  if (fs::path parent = fs::path(path).parent_path(); !parent.empty())
    fs::create_directories(parent, ec);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out.write(bytes.data(), std::streamsize(bytes.size())) || !out.flush()) {
      *error = "cannot write tokenizer to '" + path + "' (--out)";
      return false;
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) *error = "cannot write tokenizer to '" + path + "' (--out): " + ec.message();
  return !ec;
}

}  // namespace

bool train_tokenizer(const TokenizerTrainOptions& opts, std::string* error,
                     TokenizerTrainStats* stats) {
  constexpr int kMinVocab = kSpecialIds + kByteIds + 1;
  if (opts.vocab_size < kMinVocab) {
    *error = "vocab_size (--vocab-size) " + std::to_string(opts.vocab_size) +
             " is too small: the special and byte-fallback pieces alone take " +
             std::to_string(kSpecialIds + kByteIds) +
             " ids; use a few hundred more for the text's characters and merges";
    return false;
  }
  if (opts.inputs.empty()) {
    *error = "no input files or directories (--input) to train the tokenizer on";
    return false;
  }
  if (opts.out_path.empty()) {
    *error = "no output path (--out) for the tokenizer";
    return false;
  }
  std::vector<TextFile> corpus;
  TokenizerTrainStats local;
  TokenizerTrainStats& st = stats ? *stats : local;
  if (!read_corpus(opts.inputs, &corpus, error, &st.skipped)) return false;
  st.files = int(corpus.size());
  for (const auto& f : corpus) st.bytes += int64_t(f.text.size());
  if (st.bytes == 0) {
    *error =
        "no text to train the tokenizer on: the inputs (--input) hold no non-empty UTF-8 "
        "text file (" +
        std::to_string(st.skipped.size()) + " files skipped as .dat/.u8, binary or not UTF-8)";
    return false;
  }
  sentencepiece::SetRandomGeneratorSeed(kTrainSeed);
  CorpusLines lines(corpus);
  std::string model;
  if (auto s = sentencepiece::SentencePieceTrainer::Train(trainer_args(opts), &lines, &model);
      !s.ok()) {
    *error = "training the tokenizer (--vocab-size " + std::to_string(opts.vocab_size) +
             ") failed: " + detail(s);
    return false;
  }
  return write_atomically(opts.out_path, model, error);
}

}  // namespace cemlm
