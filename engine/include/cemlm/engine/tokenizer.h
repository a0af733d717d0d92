// The SentencePiece tokenizer shared by the engine, the trainer and the server, its streaming
// detokenizer, and tokenizer training. SentencePiece itself lives in a plugin (src/spm_api.h);
// this header includes no abseil either: failures return false/null and fill a
// `std::string* error`, which callers wrap into an absl::Status.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cemlm {

class Tokenizer {
 public:
  // Loads a SentencePiece model file; null when it cannot be read or is not a SentencePiece
  // model (the error names the path). max_pieces >= 0 (a model's vocab_size): a file with more
  // pieces is refused before it is loaded (as check_tokenizer_fits words it), which takes time
  // and ~25× the file's bytes.
  static std::unique_ptr<Tokenizer> load(const std::string& path, std::string* error,
                                         int max_pieces = -1);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Text to ids, no BOS/EOS added. Expects valid UTF-8 (see utf8.h). Empty with *error when the
  // model cannot encode it (SentencePiece refuses some texts of some well-formed but odd models,
  // e.g. a word model with a control piece that the text contains).
  std::optional<std::vector<int>> encode(std::string_view text, std::string* error) const;
  // Ids to text. Control ids (BOS, EOS, pad) decode to nothing; ids outside [0, vocab_size())
  // decode like unk_id() (" ⁇ "), so a model whose vocabulary is padded past the tokenizer's
  // still produces text.
  std::string decode(std::span<const int> ids) const;
  // The piece of an id ("▁the", "<0x0A>", "</s>"); empty when out of range.
  std::string id_to_piece(int id) const;
  // The byte that a byte-fallback id ("<0xE6>") stands for; -1 for any other id.
  int byte_value(int id) const {
    return id >= 0 && size_t(id) < byte_values_.size() ? byte_values_[size_t(id)] : -1;
  }

  // Whether decode drops the space of a text-initial "▁" piece (SentencePiece's
  // add_dummy_prefix: spm_train's default; `cemlm tokenizer train` leaves it off), so that
  // ids continuing a text decode differently alone than after it.
  bool drops_leading_space() const { return drops_leading_space_; }
  // For such a tokenizer, an id with text of its own after which a "▁" piece keeps its space
  // (IncrementalDetokenizer decodes after it); -1 otherwise, or when the vocabulary has none.
  int anchor_id() const { return anchor_id_; }

  // The longest piece in bytes: no token stands for more of a text than that (normalisation
  // aside), so a text of n bytes encodes to at least about n / max_piece_bytes() tokens.
  int max_piece_bytes() const { return max_piece_bytes_; }
  // At least the bytes decode(ids) gives, without decoding: each id's text alone (from a table;
  // ids past the pieces: the unknown id's), a byte more for a "▁" piece whose space decode drops
  // when it comes first, and runs of byte pieces as their bytes with U+FFFD for each that forms
  // no character. Exact for texts that encode without a dropped space (a model's denormalization
  // rules aside, which no tokenizer `cemlm tokenizer train` or spm_train writes has).
  int64_t decoded_bytes_bound(std::span<const int> ids) const;

  int vocab_size() const;
  int bos_id() const;  // -1 when the model defines none
  int eos_id() const;
  int unk_id() const;
  int pad_id() const;

 private:
  explicit Tokenizer(void* sp);
  void* sp_;  // owned: the plugin's SentencePieceProcessor
  int max_piece_bytes_ = 1;
  bool drops_leading_space_ = false;
  int anchor_id_ = -1;
  std::vector<int16_t> byte_values_;  // per id: byte_value()
  std::vector<int32_t> piece_bytes_;  // per id: decoded_bytes_bound of it alone
};

// Whether a tokenizer can serve a model of `vocab_size` token ids: false (with the reason, to
// prefix with where the tokenizer came from) when it has more pieces, whose ids the model lacks.
bool check_tokenizer_fits(const Tokenizer& tokenizer, int vocab_size, std::string* error);

// A model's document markers: the config's id when it sets one (>= 0), else the tokenizer's;
// -1 when neither defines it. The trainer encodes every document as `BOS ids EOS` with these, so
// a text input starts with the same BOS (encode_input) and generation ends at the same EOS.
int resolve_bos_id(int config_bos_id, const Tokenizer* tokenizer);
int resolve_eos_id(int config_eos_id, const Tokenizer* tokenizer);

// The ids of a text input: `bos_id` first when it is >= 0 (pass -1 for none), then
// tokenizer.encode(text); empty with *error as encode.
std::optional<std::vector<int>> encode_input(const Tokenizer& tokenizer, std::string_view text,
                                             int bos_id, std::string* error);

// Streams the text of a growing id sequence: each call takes every id generated so far and
// returns the text added since the previous call. Text is held back while it ends in an
// unfinished UTF-8 character (byte-fallback pieces that begin a character more can finish; bytes
// that can form none come out at once as U+FFFD, as decode gives them), so pieces are always
// valid UTF-8 and stop strings can be matched on them; the pieces of next() and finish()
// concatenate to tokenizer.decode(ids). For a tokenizer that drops a text-initial space, the
// ids continue `prompt`: the pieces are the text the ids add to the prompt's (a leading "▁" keeps
// its space after a prompt's word, and loses it where no id before it has text).
// Each call decodes the new ids and a few before them, whatever the length of the stream.
// One per request; the tokenizer must outlive it.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tokenizer, std::span<const int> prompt = {});
  std::string next(std::span<const int> ids);
  // The held-back rest at the end of the stream (an unfinished character becomes U+FFFD).
  std::string finish(std::span<const int> ids);
  // The ids read before the new ones that the next call decodes again (at most 4).
  size_t context_size() const { return context_.size(); }

 private:
  std::string emit(std::span<const int> ids, bool final);
  void push_context(int id);
  const Tokenizer* tokenizer_;
  std::vector<int> context_;  // the last ids read (a run of ids without text as one)
  bool last_silent_ = false;  // context_ ends in an id without text
  bool text_before_ = false;  // an id read (or the prompt's) had text
  size_t read_offset_ = 0;    // ids before this have been read
};

struct TokenizerTrainOptions {
  std::vector<std::string> inputs;  // files or directories, collected as by collect_text_files
  int vocab_size = 4096;
  std::string out_path;  // the .model file to write
  bool verbose = false;  // SentencePiece's own progress log
  // SentencePiece's trainer threads (0: cpu_threads(0); at most 128, its limit). The model file
  // records the number, so its bytes are the same for the same inputs and threads (the pieces,
  // for any threads).
  int threads = 0;
  // The caller's flags for `inputs` and for where `out_path` comes from, named in errors: the
  // trainer's are --data and --cache (`cemlm train` has --out too, for another directory).
  std::string inputs_flag = "--input", out_flag = "--out";
  // And for vocab_size: the trainer's may be a config's vocab_size, not a flag.
  std::string vocab_flag = "--vocab-size";
};

// The fewest pieces a trained tokenizer has, whatever its text: the 4 special ids, the 256 byte
// pieces and one more.
inline constexpr int kMinTrainedVocab = 261;
// The error when `vocab_size` (given by `flag`) is below kMinTrainedVocab, else "".
std::string tokenizer_vocab_too_small(const std::string& flag, int vocab_size);

struct TokenizerTrainStats {
  int files = 0;                     // text files trained on
  int64_t bytes = 0;                 // their total size
  std::vector<std::string> skipped;  // files left out (.dat/.u8, binary, not UTF-8)
  std::vector<std::string> run_dirs;  // directories of a training run's output left out
  // When training failed because vocab_size is too small: the least one that the special and
  // byte pieces and the text's characters need (0 when that was not the cause).
  int min_vocab_size = 0;
  // When it failed because the text makes fewer pieces than vocab_size: the most it makes.
  int max_vocab_size = 0;
  // The model written to out_path (its bytes as written: another process may replace the file).
  std::string model;
};

// Trains a byte-fallback BPE SentencePiece model (unk 0, bos 1, eos 2, pad 3; identity
// normalization, so decode(encode(text)) == text for any UTF-8 text) on the text files of
// `opts.inputs`, one sentence per line (a line longer than 32,767 bytes as several, cut before a
// space), and writes it to opts.out_path. Deterministic for the same inputs. False with *error
// (naming the option or path) on failure. Not reentrant: the SentencePiece trainer keeps global
// state (log level, random seed).
bool train_tokenizer(const TokenizerTrainOptions& opts, std::string* error,
                     TokenizerTrainStats* stats = nullptr);

}  // namespace cemlm
