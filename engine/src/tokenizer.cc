// Tokenizer, the incremental detokenizer and tokenizer training (see tokenizer.h) over the
// SentencePiece plugin (see spm_api.h), which is found and loaded here on first use.
#include "cemlm/engine/tokenizer.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <filesystem>
#include <mutex>
#include <unordered_map>

#include "absl/strings/escaping.h"
#include "cemlm/engine/corpus.h"
#include "cemlm/engine/cpu_threads.h"
#include "cemlm/engine/plugin.h"
#include "cemlm/engine/safetensors.h"  // write_file_atomic
#include "cemlm/engine/utf8.h"
#include "cemlm/kernels/tensor.h"  // CEMLM_CHECK
#include "spm_api.h"

namespace cemlm {
namespace {

namespace fs = std::filesystem;

constexpr int kSpecialIds = 4;  // unk, bos, eos, pad
constexpr int kByteIds = 256;   // byte fallback: one piece per byte value
constexpr unsigned kTrainSeed = 20240229;
constexpr char kPluginName[] = "libcemlm_spm.so";

// The pieces a serialized SentencePiece ModelProto holds (its repeated field 1), counted from
// the wire format without building anything; -1 where it stops parsing as a protobuf message
// (SentencePiece then says what is wrong). SentencePiece takes ~25× a model's bytes to load it.
int64_t count_pieces(std::string_view bytes) {
  size_t at = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && at < bytes.size(); shift += 7) {
      const uint8_t b = uint8_t(bytes[at++]);
      *v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  int64_t pieces = 0;
  while (at < bytes.size()) {
    uint64_t tag = 0, n = 0;
    if (!varint(&tag)) return -1;
    switch (tag & 7) {
      case 0:
        if (!varint(&n)) return -1;
        break;
      case 1:
        n = 8;
        [[fallthrough]];
      case 5:
        if ((tag & 7) == 5) n = 4;
        if (bytes.size() - at < n) return -1;
        at += n;
        break;
      case 2:
        if (!varint(&n) || bytes.size() - at < n) return -1;
        at += n;
        pieces += (tag >> 3) == 1;
        break;
      default:
        return -1;
    }
  }
  return pieces;
}

std::string too_many_pieces(int64_t pieces, int vocab_size) {
  return "the tokenizer has " + std::to_string(pieces) + " pieces but the model's vocab_size is " +
         std::to_string(vocab_size) +
         ", so some texts would encode to ids the model does not have; use the tokenizer the "
         "model was trained with, or a model with vocab_size >= " +
         std::to_string(pieces);
}
constexpr char kSpaceSymbol[] = "\xE2\x96\x81";  // U+2581 "▁", SentencePiece's space
// The ids before the new ones that a streamed decode re-reads: enough for a UTF-8 character
// begun by byte pieces (at most 3 bytes) and the piece before it.
constexpr size_t kContextIds = 4;

// The plugin's table, loaded once; null with *error when no candidate loads.
const SpmApi* spm(std::string* error) {
  static std::once_flag once;
  static const SpmApi* api = nullptr;
  static std::string failure;
  std::call_once(once, [] {
    auto entry = reinterpret_cast<const SpmApi* (*)()>(
        load_plugin_entry(kPluginName, "CEMLM_SPM_PLUGIN", CEMLM_SPM_PLUGIN_BUILD_PATH,
                          "cemlm_spm_api", /*deep_bind=*/true, &failure));
    if (entry) api = entry();
  });
  if (!api && error)
    *error = "cannot load the SentencePiece plugin " + std::string(kPluginName) +
             " (install it beside the cemlm program or set CEMLM_SPM_PLUGIN): " + failure;
  return api;
}

const SpmApi& loaded_spm() {
  const SpmApi* api = spm(nullptr);
  CEMLM_CHECK(api);  // a Tokenizer exists only once the plugin has loaded
  return *api;
}

}  // namespace

Tokenizer::Tokenizer(void* sp) : sp_(sp) {
  int spaced = -1;  // a piece that starts with "▁"
  byte_values_.assign(size_t(vocab_size()), -1);
  piece_bytes_.assign(size_t(vocab_size()), 0);
  for (int id = 0; id < vocab_size(); ++id) {
    const std::string piece = id_to_piece(id);
    const std::string text = decode(std::span<const int>(&id, 1));
    piece_bytes_[size_t(id)] = int32_t(text.size());
    max_piece_bytes_ = std::max(max_piece_bytes_, int(piece.size()));
    if (spaced < 0 && piece.starts_with(kSpaceSymbol)) spaced = id;
    // A byte-fallback piece is "<0xHH>" and does not decode to its own name.
    unsigned value = 0;
    if (piece.size() == 6 && piece.starts_with("<0x") && piece.ends_with('>') &&
        std::from_chars(piece.data() + 3, piece.data() + 5, value, 16).ptr == piece.data() + 5 &&
        text != piece)
      byte_values_[size_t(id)] = int16_t(value);
  }
  if (spaced >= 0) drops_leading_space_ = !decode(std::span<const int>(&spaced, 1)).starts_with(' ');
  if (!drops_leading_space_) return;
  // Such a piece keeps its space after other text: one byte more than alone.
  for (int id = 0; id < vocab_size(); ++id)
    if (id_to_piece(id).starts_with(kSpaceSymbol)) ++piece_bytes_[size_t(id)];
  // An id after which a "▁" piece keeps its space: one with text of its own that is no byte.
  const std::string alone = decode(std::span<const int>(&spaced, 1));
  for (int id = 0; id < vocab_size() && anchor_id_ < 0; ++id) {
    const std::string text = decode(std::span<const int>(&id, 1));
    const int pair[] = {id, spaced};
    if (!text.empty() && byte_value(id) < 0 && decode(pair) == text + " " + alone) anchor_id_ = id;
  }
}
Tokenizer::~Tokenizer() { loaded_spm().destroy(sp_); }

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path, std::string* error,
                                           int max_pieces) {
  // A model of 256k pieces is a few MB; a path to something else (a checkpoint's weights) is
  // refused by its size rather than read whole first.
  constexpr uintmax_t kMaxModelBytes = uintmax_t(256) << 20;
  std::error_code ec;
  if (const uintmax_t size = std::filesystem::file_size(path, ec); !ec && size > kMaxModelBytes) {
    *error = "tokenizer '" + path + "' is " + std::to_string(size) +
             " bytes, more than a SentencePiece model's " + std::to_string(kMaxModelBytes) +
             " at most; pass the tokenizer.model file";
    return nullptr;
  }
  std::string bytes;
  if (!read_file(path, &bytes, error)) {
    *error = "cannot load tokenizer: " + *error;
    return nullptr;
  }
  if (const int64_t pieces = count_pieces(bytes); max_pieces >= 0 && pieces > max_pieces) {
    *error = "tokenizer '" + path + "': " + too_many_pieces(pieces, max_pieces);
    return nullptr;
  }
  const SpmApi* api = spm(error);
  if (!api) return nullptr;
  std::string why;
  void* sp = api->load(bytes, &why);
  if (!sp) {
    *error = "tokenizer '" + path + "' is not a SentencePiece model" +
             // SentencePiece quotes the model's pieces: escaped, a file's bytes reach no terminal
             (why.empty() ? "" : " (" + absl::CHexEscape(why) + ")") +
             "; pass a .model file written by " + "`cemlm tokenizer train` or spm_train";
    return nullptr;
  }
  std::unique_ptr<Tokenizer> tokenizer(new Tokenizer(sp));
  // decode() stands the unknown piece in for ids past the pieces (a model's vocabulary may be
  // larger than its tokenizer's): a model whose unk_piece names no piece of type UNKNOWN has
  // none, and SentencePiece would refuse the id -1 it then gives.
  if (const int unk = tokenizer->unk_id(); unk < 0 || unk >= tokenizer->vocab_size()) {
    *error = "tokenizer '" + path + "' has no unknown piece (its trainer_spec.unk_piece names no " +
             "piece of type UNKNOWN); pass a .model file written by `cemlm tokenizer train` or " +
             "spm_train";
    return nullptr;
  }
  // SentencePiece loads pieces of any bytes; one that is not UTF-8 would reach clients in
  // decoded text, streamed tokens and proto string fields (which must hold UTF-8). Byte
  // fallback pieces are named "<0xHH>", so every piece's own text is UTF-8 in a sound model.
  for (int id = 0; id < tokenizer->vocab_size(); ++id)
    if (const std::string piece = tokenizer->id_to_piece(id); !is_valid_utf8(piece)) {
      *error = "tokenizer '" + path + "' has a piece that is not valid UTF-8 (id " +
               std::to_string(id) + ", bad byte at offset " +
               std::to_string(utf8_valid_prefix(piece)) +
               "); the model file is damaged or was converted wrongly: pass a .model file " +
               "written by `cemlm tokenizer train` or spm_train";
      return nullptr;
    }
  // The unknown id decodes to trainer_spec.unk_surface (" ⁇ " by default), not to its piece,
  // and so do ids past the pieces: the same holds for it.
  const int unk = tokenizer->unk_id();
  if (const std::string surface = tokenizer->decode(std::span<const int>(&unk, 1));
      !is_valid_utf8(surface)) {
    *error = "tokenizer '" + path + "': its unknown id decodes to text that is not valid UTF-8 " +
             "(trainer_spec.unk_surface, bad byte at offset " +
             std::to_string(utf8_valid_prefix(surface)) +
             "); the model file is damaged or was converted wrongly: pass a .model file " +
             "written by `cemlm tokenizer train` or spm_train";
    return nullptr;
  }
  return tokenizer;
}

int64_t Tokenizer::decoded_bytes_bound(std::span<const int> ids) const {
  const int32_t unknown = piece_bytes_[size_t(unk_id())];
  int64_t bytes = 0;
  // A run of byte pieces decodes to its bytes, each that forms no character as U+FFFD.
  std::string run;
  auto end_run = [&] {
    for (std::string_view rest = run; !rest.empty();) {
      const size_t valid = utf8_valid_prefix(rest);
      bytes += int64_t(valid);
      rest.remove_prefix(valid);
      if (!rest.empty()) bytes += 3, rest.remove_prefix(1);
    }
    run.clear();
  };
  for (int id : ids) {
    if (const int b = byte_value(id); b >= 0) {
      run += char(b);
      continue;
    }
    end_run();
    bytes += id >= 0 && id < vocab_size() ? piece_bytes_[size_t(id)] : unknown;
  }
  end_run();
  return bytes;
}

std::optional<std::vector<int>> Tokenizer::encode(std::string_view text, std::string* error) const {
  std::vector<int> ids;
  std::string why;
  if (loaded_spm().encode(sp_, text, &ids, &why)) return ids;
  *error = "the tokenizer cannot encode this text (SentencePiece: " + why + ")";
  return std::nullopt;
}

std::string Tokenizer::decode(std::span<const int> ids) const {
  std::vector<int> known(ids.begin(), ids.end());
  for (int& id : known)
    if (id < 0 || id >= vocab_size()) id = unk_id();
  std::string text;
  CEMLM_CHECK(loaded_spm().decode(sp_, known, &text));  // every id is in range now
  return text;
}

std::string Tokenizer::id_to_piece(int id) const {
  // SentencePiece aborts on an out-of-range id instead of reporting it.
  return id >= 0 && id < vocab_size() ? loaded_spm().id_to_piece(sp_, id) : std::string();
}

int Tokenizer::vocab_size() const { return loaded_spm().piece_size(sp_); }
int Tokenizer::bos_id() const { return loaded_spm().bos_id(sp_); }
int Tokenizer::eos_id() const { return loaded_spm().eos_id(sp_); }
int Tokenizer::unk_id() const { return loaded_spm().unk_id(sp_); }
int Tokenizer::pad_id() const { return loaded_spm().pad_id(sp_); }

bool check_tokenizer_fits(const Tokenizer& tokenizer, int vocab_size, std::string* error) {
  if (tokenizer.vocab_size() <= vocab_size) return true;
  *error = too_many_pieces(tokenizer.vocab_size(), vocab_size);
  return false;
}

int resolve_bos_id(int config_bos_id, const Tokenizer* tokenizer) {
  return config_bos_id >= 0 ? config_bos_id : tokenizer ? tokenizer->bos_id() : -1;
}

int resolve_eos_id(int config_eos_id, const Tokenizer* tokenizer) {
  return config_eos_id >= 0 ? config_eos_id : tokenizer ? tokenizer->eos_id() : -1;
}

std::optional<std::vector<int>> encode_input(const Tokenizer& tokenizer, std::string_view text,
                                             int bos_id, std::string* error) {
  std::optional<std::vector<int>> body = tokenizer.encode(text, error);
  if (body && bos_id >= 0) body->insert(body->begin(), bos_id);
  return body;
}

namespace {

// How many ids at the end of `ids` are byte-fallback pieces whose bytes begin a character without
// finishing it (0 to 3).
size_t unfinished_bytes(const Tokenizer& tokenizer, std::span<const int> ids) {
  std::string tail;  // the bytes of the last (up to 3) byte ids, in order
  for (size_t k = 1; k <= std::min<size_t>(3, ids.size()); ++k) {
    const int b = tokenizer.byte_value(ids[ids.size() - k]);
    if (b < 0) break;
    tail.insert(tail.begin(), char(b));
  }
  return utf8_unfinished_suffix(tail);
}

}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer,
                                               std::span<const int> prompt)
    : tokenizer_(&tokenizer) {
  if (!tokenizer.drops_leading_space()) return;
  // The prompt's text so far decides whether a first "▁" keeps its space; its last ids are the
  // context (they may have begun a character the new ids finish).
  for (auto it = prompt.rbegin(); it != prompt.rend() && !text_before_; ++it)
    text_before_ = !tokenizer.decode(std::span<const int>(&*it, 1)).empty();
  for (const int id : prompt) push_context(id);
}

std::string IncrementalDetokenizer::next(std::span<const int> ids) { return emit(ids, false); }
std::string IncrementalDetokenizer::finish(std::span<const int> ids) { return emit(ids, true); }

void IncrementalDetokenizer::push_context(int id) {
  // Runs of ids without text (BOS, EOS, pad) count as one: they only end a run of bytes.
  const bool silent = tokenizer_->byte_value(id) < 0 &&
                      tokenizer_->decode(std::span<const int>(&id, 1)).empty() &&
                      !tokenizer_->id_to_piece(id).starts_with(kSpaceSymbol);
  if (silent && last_silent_) return;
  last_silent_ = silent;
  context_.push_back(id);
  if (context_.size() > kContextIds) context_.erase(context_.begin());
}

std::string IncrementalDetokenizer::emit(std::span<const int> ids, bool final) {
  CEMLM_CHECK(ids.size() >= read_offset_);
  // After text, a tokenizer that drops a text-initial space decodes the window after an anchor
  // piece, so that a "▁" the window starts with keeps its space as it does in the whole text.
  std::vector<int> window;
  const int anchor = tokenizer_->anchor_id();
  if (text_before_ && anchor >= 0) window.push_back(anchor);
  window.insert(window.end(), context_.begin(), context_.end());
  const size_t context_size = window.size();
  window.insert(window.end(), ids.begin() + read_offset_, ids.end());
  // The byte ids that end the window with a character still unfinished wait for the rest of it
  // (the prompt's last ids may have begun it); at the end they decode as U+FFFD.
  const size_t unfinished = final ? 0 : unfinished_bytes(*tokenizer_, window);
  const size_t end = ids.size() - std::min(unfinished, ids.size() - read_offset_);
  if (end == read_offset_) return "";
  window.resize(window.size() - (ids.size() - end));
  const std::string context = tokenizer_->decode(std::span<const int>(window).first(context_size));
  const std::string text = tokenizer_->decode(window);
  // The context is text already out, but a context ending in part of a character decodes it as
  // U+FFFD, which the ids after it may complete: the characters after the common part are new.
  size_t old = size_t(
      std::mismatch(context.begin(), context.end(), text.begin(), text.end()).first -
      context.begin());
  while (old > 0 && old < text.size() && (uint8_t(text[old]) & 0xC0) == 0x80) --old;
  // Ids without text (a run of EOS under ignore_eos) are read too: the window stays a few ids.
  for (size_t i = read_offset_; i < end; ++i) push_context(ids[i]);
  read_offset_ = end;
  if (text.size() <= old) return "";
  text_before_ = true;
  return text.substr(old);
}

namespace {

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
      // Longer lines are fed in parts of at most this many bytes (engine/spm/spm_plugin.cc). Not
      // more: SentencePiece 0.1.97's BPE trainer keeps a character's place in a sentence in 16
      // bits of a signed int, and crashed on a run of 32,768 characters without a space (a base64
      // blob, minified code).
      {"max_sentence_length", "32767"},
      // SentencePiece refuses more than 128 (`--threads 129` failed the run "with no reason").
      {"num_threads",
       std::to_string(std::min(128, opts.threads > 0 ? opts.threads : cpu_threads(0).threads))},
      {"minloglevel", opts.verbose ? "0" : "2"},
  };
}

// The model file appears whole or not at all (synced temporary, renamed); a failure leaves no
// temporary behind.
bool write_atomically(const std::string& path, const std::string& bytes, const std::string& flag,
                      std::string* error) {
  std::error_code ec;
  if (fs::path parent = fs::path(path).parent_path(); !parent.empty())
    fs::create_directories(parent, ec);
  const absl::Status st = write_file_atomic(path, [&](std::FILE* f) {
    return std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size()
               ? absl::OkStatus()
               : absl::UnavailableError("short write");
  });
  if (!st.ok())
    *error =
        "cannot write tokenizer to '" + path + "' (" + flag + "): " + std::string(st.message());
  return st.ok();
}

}  // namespace

std::string tokenizer_vocab_too_small(const std::string& flag, int vocab_size) {
  static_assert(kSpecialIds + kByteIds + 1 == kMinTrainedVocab);
  if (vocab_size >= kMinTrainedVocab) return "";
  return flag + " " + std::to_string(vocab_size) +
         " is too small: the special and byte-fallback pieces alone take " +
         std::to_string(kSpecialIds + kByteIds) +
         " ids; use a few hundred more for the text's characters and merges";
}

bool train_tokenizer(const TokenizerTrainOptions& opts, std::string* error,
                     TokenizerTrainStats* stats) {
  TokenizerTrainStats local;
  TokenizerTrainStats& st = stats ? *stats : local;
  if (*error = tokenizer_vocab_too_small(opts.vocab_flag, opts.vocab_size); !error->empty()) {
    st.min_vocab_size = kMinTrainedVocab;
    return false;
  }
  if (opts.inputs.empty()) {
    *error = "no input files or directories (" + opts.inputs_flag + ") to train the tokenizer on";
    return false;
  }
  if (opts.out_path.empty()) {
    *error = "no output path (" + opts.out_flag + ") for the tokenizer";
    return false;
  }
  std::vector<TextFile> corpus;
  if (!read_corpus(opts.inputs, &corpus, error, &st.skipped, &st.run_dirs)) return false;
  st.files = int(corpus.size());
  for (const auto& f : corpus) st.bytes += int64_t(f.text.size());
  if (st.bytes == 0) {
    *error = "no text to train the tokenizer on: the inputs (" + opts.inputs_flag +
             ") hold no non-empty UTF-8 text file (" + std::to_string(st.skipped.size()) +
             " files skipped as .dat/.u8, binary or not UTF-8";
    for (size_t i = 0; i < st.run_dirs.size(); ++i)
      *error += (i ? "; '" : "; left out as training runs' checkpoints or token caches: '") +
                st.run_dirs[i] + "'";
    *error += ")";
    return false;
  }
  // SentencePiece fails on blank text without a reason, or asks for a smaller vocabulary.
  const bool blank = std::all_of(corpus.begin(), corpus.end(), [](const TextFile& f) {
    return std::all_of(f.text.begin(), f.text.end(),
                       [](char c) { return std::isspace(static_cast<unsigned char>(c)); });
  });
  if (blank) {
    *error = "no text to train the tokenizer on: the inputs (" + opts.inputs_flag +
             ") hold only blank lines and spaces (" + std::to_string(st.bytes) + " bytes in " +
             std::to_string(st.files) + " files)";
    return false;
  }
  const SpmApi* api = spm(error);
  if (!api) return false;
  std::string model, why;
  if (!api->train(trainer_args(opts), corpus, kTrainSeed, &model, &why)) {
    // SentencePiece's "Vocabulary size is smaller than required_chars. 300 vs 331. ..." speaks
    // of its own options; say it in terms of ours.
    // Its "Vocabulary size too high (512). Please set it to a value <= 375.", for a text too
    // small to make that many pieces, too.
    const size_t at = why.find("required_chars. "), high = why.find("Please set it to a value <= ");
    int asked = 0, needed = 0, most = 0;
    if (at != std::string::npos &&
        std::sscanf(why.c_str() + at + 16, "%d vs %d", &asked, &needed) == 2) {
      st.min_vocab_size = needed;
      *error = opts.vocab_flag + " " + std::to_string(asked) + " is too small for this text: its " +
               "characters and the special and byte pieces need " + std::to_string(needed) +
               " ids before any merge; use at least " + std::to_string(needed) +
               ", plus a few hundred for merges";
    } else if (high != std::string::npos &&
               std::sscanf(why.c_str() + high + 28, "%d", &most) == 1) {
      st.max_vocab_size = most;
      *error = opts.vocab_flag + " " + std::to_string(opts.vocab_size) +
               " is more pieces than this text makes (" + std::to_string(st.bytes) +
               " bytes): at most " + std::to_string(most) + "; use at most " +
               std::to_string(most) + ", or give more text";
    } else {
      *error =
          "training the tokenizer (" + opts.vocab_flag + " " + std::to_string(opts.vocab_size) +
          ") failed: " +
          (why.empty()
               ? "SentencePiece gave no reason (`cemlm tokenizer train --verbose` shows its log)"
               : why);
    }
    return false;
  }
  if (!write_atomically(opts.out_path, model, opts.out_flag, error)) return false;
  st.model = std::move(model);
  return true;
}

}  // namespace cemlm
