// Corpus listing and keys, document encoding, the token cache file and window sampling.
// Cache layout (little-endian): "CEMLMTOK", u32 version, u32 n_files, u64 corpus key, u64
// tokenizer hash, u64 hash of what follows, u64 token count per file, then the int32 ids of all
// files in order.
#include "cemlm/trainer/data.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/checkpoint.h"
#include "cemlm/engine/corpus.h"
#include "cemlm/engine/safetensors.h"
#include "cemlm/engine/status.h"

namespace cemlm {
namespace {

namespace fs = std::filesystem;

// 1 had no content hash; 2 kept a file's leading byte-order mark as three ids.
constexpr uint32_t kCacheVersion = 3;

template <typename T>
uint64_t hash_value(const T& v, uint64_t h) {
  return hash_bytes({reinterpret_cast<const char*>(&v), sizeof(v)}, h);
}

struct CacheHeader {
  char magic[8];
  uint32_t version, n_files;
  uint64_t corpus_key, encoding;  // the tokenizer and the bos/eos ids
  uint64_t content;               // hash_bytes of the counts and the ids
};

// Per-file ids from a cache written for this corpus and tokenizer; empty when there is none, or
// when it is damaged (contents that do not match their hash, counts that do not add up to its
// size, ids outside [0, vocab)): it is then encoded again. The hash catches what the other
// checks cannot, such as an id changed into another id of the vocabulary.
std::vector<std::vector<int32_t>> read_cache(const std::string& path, const CorpusFiles& corpus,
                                             uint64_t encoding, int vocab) {
  std::string bytes, error;
  if (!read_file(path, &bytes, &error) || bytes.size() < sizeof(CacheHeader)) return {};
  CacheHeader h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (std::memcmp(h.magic, kTokenCacheMagic, 8) || h.version != kCacheVersion ||
      h.n_files != corpus.paths.size() || h.corpus_key != corpus.key || h.encoding != encoding)
    return {};
  size_t pos = sizeof(h) + h.n_files * sizeof(uint64_t);
  if (bytes.size() < pos || hash_bytes(std::string_view(bytes).substr(sizeof(h))) != h.content)
    return {};
  std::vector<uint64_t> counts(h.n_files);
  if (h.n_files > 0)  // (an empty vector's data() may be null, which memcpy must not be given)
    std::memcpy(counts.data(), bytes.data() + sizeof(h), h.n_files * sizeof(uint64_t));
  const uint64_t ids = (bytes.size() - pos) / sizeof(int32_t);
  uint64_t total = 0;
  for (uint64_t n : counts) {
    if (n > ids - total) return {};  // more ids than the file holds (an overflow included)
    total += n;
  }
  if (bytes.size() != pos + total * sizeof(int32_t)) return {};
  std::vector<std::vector<int32_t>> files(h.n_files);
  for (size_t i = 0; i < files.size(); ++i) {
    if (counts[i] == 0) continue;  // a blank file: no ids (and data() may be null)
    files[i].resize(counts[i]);
    std::memcpy(files[i].data(), bytes.data() + pos, counts[i] * sizeof(int32_t));
    pos += counts[i] * sizeof(int32_t);
    for (int32_t id : files[i])
      if (id < 0 || id >= vocab) return {};
  }
  return files;
}

absl::Status write_cache(const std::string& path, const CorpusFiles& corpus,
                         uint64_t encoding, const std::vector<std::vector<int32_t>>& files) {
  std::error_code ec;
  if (fs::path parent = fs::path(path).parent_path(); !parent.empty())
    fs::create_directories(parent, ec);
  return write_file_atomic(path, [&](std::FILE* f) {
    CacheHeader h;
    std::memcpy(h.magic, kTokenCacheMagic, 8);
    h.version = kCacheVersion;
    h.n_files = uint32_t(files.size());
    h.corpus_key = corpus.key;
    h.encoding = encoding;
    h.content = hash_bytes("");
    for (const auto& ids : files) h.content = hash_value(uint64_t(ids.size()), h.content);
    for (const auto& ids : files)
      h.content = hash_bytes(
          {reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int32_t)}, h.content);
    bool ok = std::fwrite(&h, sizeof(h), 1, f) == 1;
    for (const auto& ids : files) {
      const uint64_t n = ids.size();
      ok = ok && std::fwrite(&n, sizeof(n), 1, f) == 1;
    }
    // A blank file has no ids, and an empty vector's data() may be null, which fwrite must not
    // be given even to write nothing.
    for (const auto& ids : files)
      ok = ok &&
           (ids.empty() || std::fwrite(ids.data(), sizeof(int32_t), ids.size(), f) == ids.size());
    return ok ? absl::OkStatus()
              : absl::UnavailableError(absl::StrCat("cannot write the token cache '", path, "'"));
  });
}

bool is_separator(std::string_view line) { return line == "%" || line == "%\r"; }

bool is_blank(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char ch) { return std::isspace((unsigned char)ch); });
}

// Where to end a piece of `doc` that starts at `from` and holds at most `most` bytes: after its
// last '\n', else before its last space that follows no space, else at the next '\n' after it
// (the document's end when none). The tokenizers cemlm trains learn no piece holding a '\n' (they
// train on lines) nor a space within or at the end of one, so the pieces' ids are the document's.
size_t piece_end(std::string_view doc, size_t from, size_t most) {
  if (doc.size() - from <= most) return doc.size();
  const std::string_view window = doc.substr(from, most);
  if (const size_t nl = window.rfind('\n'); nl != std::string_view::npos) return from + nl + 1;
  for (size_t sp = window.rfind(' '); sp != std::string_view::npos && sp > 0;
       sp = window.rfind(' ', sp - 1))
    if (window[sp - 1] != ' ') return from + sp;
  const size_t nl = doc.find('\n', from + most);
  return nl == std::string_view::npos ? doc.size() : nl + 1;
}

// Whether a text encoded in pieces cut as piece_end() cuts it gets the text's own ids: so for the
// tokenizers cemlm trains, not for one that puts a "▁" before every text (add_dummy_prefix,
// spm_train's default and Llama's), which gained a space at every cut.
bool cuts_keep_ids(const Tokenizer& tokenizer) {
  std::string error;
  std::vector<int> pieces;
  for (std::string_view piece : {"ab\n", "cd", " ef"}) {
    const std::optional<std::vector<int>> ids = tokenizer.encode(piece, &error);
    if (!ids) return false;
    pieces.insert(pieces.end(), ids->begin(), ids->end());
  }
  return tokenizer.encode("ab\ncd ef", &error) == pieces;
}

// The document at byte `at` of its file, encoded `piece_bytes` at a time (see encode_documents).
absl::Status append_document(std::string_view doc, size_t at, const Tokenizer& tokenizer, int bos,
                             int eos, size_t piece_bytes, const std::function<bool()>& stop,
                             std::vector<int32_t>* out) {
  if (is_blank(doc)) return absl::OkStatus();
  for (size_t from = 0; from < doc.size();) {
    if (from > 0 && stop && stop()) return absl::CancelledError("stopped while encoding --data");
    const size_t end = piece_end(doc, from, piece_bytes);
    std::string error;
    const std::optional<std::vector<int>> ids =
        from == 0 ? encode_input(tokenizer, doc.substr(0, end), bos, &error)
                  : tokenizer.encode(doc.substr(from, end - from), &error);
    if (!ids)
      return absl::InvalidArgumentError(absl::StrCat("the document at byte ", at, ": ", error,
                                                     "; remove it or use another tokenizer"));
    out->insert(out->end(), ids->begin(), ids->end());
    from = end;
  }
  if (eos >= 0) out->push_back(eos);
  return absl::OkStatus();
}

}  // namespace

uint64_t hash_bytes(std::string_view bytes, uint64_t h) {
  for (unsigned char ch : bytes) h = (h ^ ch) * 0x100000001b3ULL;
  return h;
}

absl::StatusOr<uint64_t> hash_file(const std::string& path) {
  std::string bytes, error;
  if (!read_file(path, &bytes, &error)) return absl::NotFoundError(error);
  return hash_bytes(bytes);
}

namespace {
// Whether `file` lies inside `dir` or inside a "<dir>.tmp-*" sibling (both made absolute).
bool inside(const fs::path& file, const fs::path& dir) {
  const std::string f = file.string(), d = dir.string();
  return f.rfind(d + "/", 0) == 0 || f.rfind(d + ".tmp-", 0) == 0;
}
}  // namespace

absl::StatusOr<CorpusFiles> list_corpus(const std::vector<std::string>& inputs,
                                        const std::vector<std::string>& exclude) {
  CorpusFiles c;
  std::string error;
  std::vector<std::string> found, why_skipped;
  if (!collect_text_files(inputs, &found, &error, &c.skipped, &why_skipped, &c.run_dirs))
    return absl::NotFoundError(absl::StrCat("--data: ", error));
  // The resolved path, or where symlinks cannot be resolved (a loop) the lexical absolute one.
  auto resolved = [](const std::string& p) {
    std::error_code ec;
    const fs::path abs = fs::absolute(p, ec).lexically_normal();
    fs::path r = fs::weakly_canonical(abs, ec);
    return ec ? abs : r;
  };
  std::vector<fs::path> excluded;
  for (const std::string& d : exclude) {
    fs::path p = resolved(d);
    if (!p.has_filename()) p = p.parent_path();
    excluded.push_back(p);
  }
  auto is_excluded = [&](const std::string& p) {
    const fs::path abs = resolved(p);
    return std::any_of(excluded.begin(), excluded.end(),
                       [&](const fs::path& d) { return inside(abs, d); });
  };
  // The run's own binaries (weights, token cache) are left out as the run's, not as bad text.
  for (size_t i = 0; i < c.skipped.size(); ++i)
    if (!why_skipped[i].empty() && !is_excluded(c.skipped[i]))
      c.not_text.push_back(std::move(why_skipped[i]));
  for (std::string& p : found) (is_excluded(p) ? c.skipped : c.paths).push_back(std::move(p));
  // This run's own --out and --cache are left out as such, not as another run's.
  std::erase_if(c.run_dirs, [&](const std::string& d) {
    const fs::path abs = resolved(d);
    return std::any_of(excluded.begin(), excluded.end(),
                       [&](const fs::path& e) { return abs == e || inside(abs, e); });
  });
  uint64_t h = hash_bytes("cemlm corpus v1");
  for (const std::string& p : c.paths) {
    std::error_code ec;
    const uint64_t size = fs::file_size(p, ec);
    const int64_t mtime = fs::last_write_time(p, ec).time_since_epoch().count();
    if (ec) return absl::UnavailableError(absl::StrCat("--data: cannot stat '", p, "'"));
    h = hash_value(mtime, hash_value(size, hash_bytes(p, hash_value(p.size(), h))));
  }
  c.key = h;
  return c;
}

absl::StatusOr<std::vector<int32_t>> encode_documents(std::string_view text,
                                                      const Tokenizer& tokenizer, int bos, int eos,
                                                      size_t piece_bytes,
                                                      const std::function<bool()>& stop) {
  if (!cuts_keep_ids(tokenizer)) piece_bytes = SIZE_MAX;  // whole documents
  std::vector<int32_t> out;
  // A byte-order mark starting a file (Windows editors write one) is no text of its first
  // document: it became three byte ids after its BOS.
  constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";
  size_t doc_begin = text.starts_with(kUtf8Bom) ? kUtf8Bom.size() : 0, pos = doc_begin;
  while (pos < text.size()) {
    const size_t end = std::min(text.find('\n', pos), text.size());
    if (is_separator(text.substr(pos, end - pos))) {
      CEMLM_RETURN_IF_ERROR(append_document(text.substr(doc_begin, pos - doc_begin), doc_begin,
                                            tokenizer, bos, eos, piece_bytes, stop, &out));
      doc_begin = std::min(end + 1, text.size());
    }
    pos = end + 1;
  }
  CEMLM_RETURN_IF_ERROR(append_document(text.substr(doc_begin), doc_begin, tokenizer, bos, eos,
                                        piece_bytes, stop, &out));
  return out;
}

ValidationPart validation_part(std::span<const int32_t> ids, double val_fraction, int bos,
                               int eos) {
  const size_t n = ids.size();
  const size_t cut = n - size_t(std::ceil(double(n) * val_fraction));
  if (cut == 0 || cut == n || (bos < 0 && eos < 0)) return {cut, n};
  // A document starts at its BOS, after the previous one's EOS (both, when a model has both: the
  // same id may serve as both markers).
  auto starts_document = [&](size_t p) {
    return bos >= 0 ? ids[p] == bos && (eos < 0 || ids[p - 1] == eos) : ids[p - 1] == eos;
  };
  // Within [half, twice] the asked validation size.
  const size_t n_val = n - cut;
  const size_t lo = n > 2 * n_val ? n - 2 * n_val : 1, hi = n - (n_val + 1) / 2;
  for (size_t d = 0; cut >= lo + d || cut + d <= hi; ++d) {
    if (cut >= lo + d && starts_document(cut - d)) return {cut - d, n};
    if (cut + d <= hi && starts_document(cut + d)) return {cut + d, n};
  }
  // The cut falls inside a document: its end trains, the ids before it validate.
  const size_t keep = std::min(n_val, cut / 2);
  if (eos < 0 || ids[n - 1] != eos || keep == 0) return {cut, n, true};
  return {cut - keep, n - keep, true};
}

std::vector<ValidationPart> validation_parts(const std::vector<std::vector<int32_t>>& files,
                                             double val_fraction, int bos, int eos) {
  std::vector<ValidationPart> parts;
  size_t inside = 0;
  for (const auto& ids : files) {
    parts.push_back(validation_part(ids, val_fraction, bos, eos));
    inside += parts.back().inside_document;
  }
  if (val_fraction <= 0 || double(inside) < std::ceil(1 / val_fraction)) return parts;
  double total = 0, val = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    if (!parts[i].inside_document) continue;
    const size_t n = files[i].size();
    total += double(n);
    const bool to_val = val < val_fraction * total;
    parts[i] = {to_val ? 0 : n, n, true};
    if (to_val) val += double(n);
  }
  return parts;
}

absl::StatusOr<TokenData> load_token_data(const CorpusFiles& corpus, const Tokenizer& tokenizer,
                                          uint64_t tokenizer_hash, int bos, int eos,
                                          const std::string& cache_path, double val_fraction,
                                          const std::function<bool()>& stop) {
  TokenData data;
  data.files = int(corpus.paths.size());
  // The ids depend on the document markers too: a config with other bos/eos ids re-encodes.
  const uint64_t encoding = hash_value(eos, hash_value(bos, tokenizer_hash));
  std::vector<std::vector<int32_t>> files = read_cache(
      cache_path, corpus, encoding, std::max({tokenizer.vocab_size(), bos + 1, eos + 1}));
  data.from_cache = !files.empty();
  if (!data.from_cache) {
    for (const std::string& p : corpus.paths) {
      if (stop && stop()) return absl::CancelledError("stopped while encoding --data");
      std::string text, error;
      if (!read_text_file(p, &text, &error)) return absl::UnavailableError("--data: " + error);
      absl::StatusOr<std::vector<int32_t>> ids =
          encode_documents(text, tokenizer, bos, eos, kEncodePieceBytes, stop);
      if (absl::IsCancelled(ids.status())) return ids.status();
      if (!ids.ok())
        return absl::InvalidArgumentError(
            absl::StrCat("--data: '", p, "': ", ids.status().message()));
      files.push_back(*std::move(ids));
    }
    CEMLM_RETURN_IF_ERROR(write_cache(cache_path, corpus, encoding, files));
  }
  const std::vector<ValidationPart> parts = validation_parts(files, val_fraction, bos, eos);
  for (size_t i = 0; i < files.size(); ++i) {
    const std::vector<int32_t>& ids = files[i];
    const ValidationPart& v = parts[i];
    data.train.insert(data.train.end(), ids.begin(), ids.begin() + long(v.begin));
    data.val.insert(data.val.end(), ids.begin() + long(v.begin), ids.begin() + long(v.end));
    data.train.insert(data.train.end(), ids.begin() + long(v.end), ids.end());
  }
  return data;
}

void sample_windows(const std::vector<int32_t>& tokens, int len, int batch, Rng& rng, int* ids) {
  CEMLM_CHECK(tokens.size() >= size_t(len));
  const uint64_t starts = tokens.size() - len + 1;
  for (int b = 0; b < batch; ++b) {
    const uint64_t start = rng.next_u64() % starts;
    std::copy_n(tokens.begin() + start, len, ids + int64_t(b) * len);
  }
}

std::vector<int> eval_windows(const std::vector<int32_t>& tokens, int len, int max_windows) {
  const size_t count = std::min<size_t>(max_windows, tokens.size() / len);
  std::vector<int> ids;
  for (size_t k = 0; k < count; ++k) {
    const size_t start = k * (tokens.size() / count);
    ids.insert(ids.end(), tokens.begin() + start, tokens.begin() + start + len);
  }
  return ids;
}

}  // namespace cemlm
