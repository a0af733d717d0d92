// Training data: text files → documents → token ids, cached in one binary file keyed by the
// inputs (paths, sizes, mtimes) and the tokenizer, split deterministically into train and
// validation, and cut into windows: random ones for training, fixed ones for evaluation.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "cemlm/engine/params.h"
#include "cemlm/engine/tokenizer.h"

namespace cemlm {

// The text files of the inputs (collect_text_files) and a key that changes when any of them
// is added, removed, resized or touched.
struct CorpusFiles {
  std::vector<std::string> paths;
  std::vector<std::string> skipped;  // .dat/.u8, binary, not UTF-8, or in an excluded directory
  // Of `skipped`, those left out for what they hold (binary, not UTF-8) outside the excluded
  // directories, each said as "'path' is not UTF-8 text: why": a user's file with one stray byte
  // is otherwise lost unseen, unlike the .dat/.u8 files of a fortunes directory, which are left
  // out by design, or the run's own output.
  std::vector<std::string> not_text;
  // Directories of other runs' output under the inputs, left unwalked (is_run_output_dir); not
  // the excluded ones (this run's own).
  std::vector<std::string> run_dirs;
  uint64_t key = 0;
};
// The text files under `inputs`, leaving out any inside one of the `exclude` directories or in a
// save's temporary sibling of one ("<dir>.tmp-*"): a run's own output and cache are not its data.
absl::StatusOr<CorpusFiles> list_corpus(const std::vector<std::string>& inputs,
                                        const std::vector<std::string>& exclude = {});

// 64-bit FNV-1a, for cache keys (not for security).
uint64_t hash_bytes(std::string_view bytes, uint64_t h = 0xcbf29ce484222325ULL);
absl::StatusOr<uint64_t> hash_file(const std::string& path);

// SentencePiece's BPE holds ~170 bytes per byte of a text it encodes: a document is encoded in
// pieces of about this many bytes (a plain text file, without "%" lines, is one document; a 38 MB
// book took 6.7 GB whole).
inline constexpr size_t kEncodePieceBytes = size_t(64) << 10;

// A file's text as documents: a line holding only "%" (the fortune-file format) separates
// documents; each non-blank document becomes [bos] ids [eos] (bos/eos left out when < 0),
// its ids encoded `piece_bytes` at a time, each piece cut after a '\n' (else before a space; a
// line without either is not cut), which for the tokenizers cemlm trains gives the ids of the
// whole document; a tokenizer for which it would not (one with a dummy prefix, which puts a "▁"
// before every piece) encodes documents whole. An error names the byte offset of a document the
// tokenizer cannot encode; CancelledError when `stop` says so between two pieces.
absl::StatusOr<std::vector<int32_t>> encode_documents(std::string_view text,
                                                      const Tokenizer& tokenizer, int bos, int eos,
                                                      size_t piece_bytes = kEncodePieceBytes,
                                                      const std::function<bool()>& stop = nullptr);

struct TokenData {
  std::vector<int32_t> train, val;
  int files = 0;
  bool from_cache = false;
};

// Token ids of `corpus`, read from `cache_path` when it was written for the same corpus key and
// tokenizer hash, else encoded and cached there (atomically). Each file's validation part is
// validation_part()'s, the rest of it training, so that every file is in both (kSplitRule names
// this rule in a run's saved state). `stop` is asked before each file is encoded: true ends with
// a CancelledError, and nothing is cached.
inline constexpr char kSplitRule[] = "document-start,end-trains,whole-files";
// A file's validation ids, ids[begin, end); the others train.
struct ValidationPart {
  size_t begin = 0, end = 0;
  bool inside_document = false;  // the cut fell inside a document (no start near it)
};
// The file's last `val_fraction` of `ids`, its start moved to the nearest document start when one
// lies within half to twice that validation size, so that no document is split between training
// and validation. With no start there (the cut falls inside a document: a file that is one long
// document, say), validation keeps its size but moves back: the file's end through its EOS, as
// many ids as validation holds (at most half of the rest), stays in training, which then jumps
// over validation mid-document once. Else a corpus of one-document files would never train on an
// EOS (nor learn to end a generation). Without document markers, or without an EOS at the file's
// end, the plain cut.
ValidationPart validation_part(std::span<const int32_t> ids, double val_fraction, int bos, int eos);
// Every file's validation_part(), except when the corpus has at least 1 / val_fraction files
// whose cut falls inside a document (a directory of one short document per file, say): those
// then go to validation or training whole, in order, each to validation while the validation
// share of their ids is below val_fraction. Cut, each gave validation a few ids from before its
// EOS, which both holed every document and made validation windows of glued fragments (a review
// measured validation perplexity 97.5 against 59.8 on the same documents in one file).
std::vector<ValidationPart> validation_parts(const std::vector<std::vector<int32_t>>& files,
                                             double val_fraction, int bos, int eos);
absl::StatusOr<TokenData> load_token_data(const CorpusFiles& corpus, const Tokenizer& tokenizer,
                                          uint64_t tokenizer_hash, int bos, int eos,
                                          const std::string& cache_path, double val_fraction,
                                          const std::function<bool()>& stop = {});

// `batch` windows of `len` tokens from uniformly random offsets, written row-major into `ids`.
void sample_windows(const std::vector<int32_t>& tokens, int len, int batch, Rng& rng, int* ids);

// Up to `max_windows` non-overlapping windows of `len` tokens spread evenly over `tokens`,
// row-major; the same every time, so that validation losses are comparable across steps.
std::vector<int> eval_windows(const std::vector<int32_t>& tokens, int len, int max_windows);

}  // namespace cemlm
