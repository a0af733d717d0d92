// The data pipeline: document encoding, the token cache (reused while the inputs and the
// tokenizer are unchanged, rebuilt when either changes), the split, and window sampling.
#include "cemlm/trainer/data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <set>

#include "../tokenizer/test_files.h"
#include "absl/strings/str_join.h"
#include "cemlm/engine/corpus.h"
#include "tokenizer_util.h"
#include "trainer_test_util.h"

namespace cemlm {
namespace {

namespace fs = std::filesystem;
using testing_tokens::encode_ok;
using testing_trainer::fresh_dir;
using testing_trainer::write_file;

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fresh_dir();
    write_file(dir_ + "/text/a.txt", testing_trainer::corpus_text(200, 1));
    write_file(dir_ + "/text/b.txt", testing_trainer::corpus_text(100, 2));
    write_file(dir_ + "/text/a.dat", std::string("\0\1binary", 8));
    std::string error;
    ASSERT_TRUE(train_tokenizer({{dir_ + "/text"}, 300, dir_ + "/tok.model"}, &error)) << error;
    tokenizer_ = Tokenizer::load(dir_ + "/tok.model", &error);
    ASSERT_TRUE(tokenizer_) << error;
  }
  absl::StatusOr<TokenData> load(double val = 0.1, int bos = 1, int eos = 2) {
    auto corpus = list_corpus({dir_ + "/text"});
    if (!corpus.ok()) return corpus.status();
    auto hash = hash_file(dir_ + "/tok.model");
    if (!hash.ok()) return hash.status();
    return load_token_data(*corpus, *tokenizer_, *hash, bos, eos, dir_ + "/cache/tokens.bin", val);
  }
  std::string dir_;
  std::unique_ptr<Tokenizer> tokenizer_;
};

TEST_F(DataTest, DocumentsAreSeparatedByPercentLines) {
  const auto ids = encode_documents("one\n%\n\n%\ntwo\nlines\n%\n", *tokenizer_, 1, 2).value();
  std::vector<int32_t> want = {1};
  for (int id : encode_ok(*tokenizer_, "one\n")) want.push_back(id);
  want.push_back(2);
  want.push_back(1);  // the blank document in between is dropped
  for (int id : encode_ok(*tokenizer_, "two\nlines\n")) want.push_back(id);
  want.push_back(2);
  EXPECT_EQ(ids, want);
  // No separator: the whole text is one document; negative ids add no markers.
  std::vector<int32_t> plain;
  for (int id : encode_ok(*tokenizer_, "no separators\n")) plain.push_back(id);
  EXPECT_EQ(encode_documents("no separators\n", *tokenizer_, -1, -1).value(), plain);
  // A byte-order mark starting the file is none of its text (it became three byte ids); one
  // elsewhere is left as it is.
  EXPECT_EQ(encode_documents("\xEF\xBB\xBFno separators\n", *tokenizer_, -1, -1).value(), plain);
  EXPECT_NE(encode_documents("no \xEF\xBB\xBFseparators\n", *tokenizer_, -1, -1).value(), plain);
}

// A long document is encoded in pieces (SentencePiece's BPE holds ~170 bytes per byte of what it
// encodes): cut after a newline, else before a space, which for a tokenizer cemlm trained gives
// the ids of the whole document. Pieces of 1 to 200 bytes against one piece, on a document with
// blank lines, runs of spaces, lines longer than a piece and a line with no space at all.
TEST_F(DataTest, ALongDocumentEncodedInPiecesHasTheIdsOfTheWhole) {
  std::string doc = testing_trainer::corpus_text(60, 3);
  for (size_t at = 0; (at = doc.find("%\n", at)) != std::string::npos;) doc.replace(at, 2, "\n");
  doc += "the cat  sees   a red apple and the old man follows the quiet river to the open door\n";
  doc += std::string(150, 'x') + "\n\n  leading spaces then words\n" + std::string(90, 'y');
  const std::vector<int32_t> whole = encode_documents(doc, *tokenizer_, 1, 2, doc.size()).value();
  ASSERT_GT(whole.size(), 100u);
  for (size_t piece : {1, 2, 7, 16, 33, 64, 100, 200}) {
    SCOPED_TRACE(piece);
    EXPECT_EQ(encode_documents(doc, *tokenizer_, 1, 2, piece).value(), whole);
    // And within a file of several documents.
    EXPECT_EQ(encode_documents("one\n%\n" + doc + "%\n", *tokenizer_, 1, 2, piece).value(),
              encode_documents("one\n%\n" + doc + "%\n", *tokenizer_, 1, 2, doc.size()).value());
  }
  // A tokenizer with a dummy prefix (spm_train's default, Llama's) puts a "▁" before every text
  // it encodes, so pieces would gain a space at every cut: it encodes the document whole.
  std::string bytes, error;
  ASSERT_TRUE(read_file(dir_ + "/tok.model", &bytes, &error)) << error;
  write_file(dir_ + "/dummy.model", testing_files::with_dummy_prefix(bytes));
  const auto dummy = Tokenizer::load(dir_ + "/dummy.model", &error);
  ASSERT_TRUE(dummy) << error;
  const std::vector<int32_t> dummy_whole = encode_documents(doc, *dummy, 1, 2, doc.size()).value();
  EXPECT_EQ(encode_documents(doc, *dummy, 1, 2, 16).value(), dummy_whole);
  EXPECT_NE(dummy_whole, whole);  // the prefix does change the ids
  // A stop asked for between two pieces ends the encoding.
  int asked = 0;
  const auto stopped = encode_documents(doc, *tokenizer_, 1, 2, 64, [&] { return ++asked == 3; });
  EXPECT_TRUE(absl::IsCancelled(stopped.status())) << stopped.status();
}

// A document the tokenizer refuses to encode is an error naming where it starts, and the file.
TEST_F(DataTest, ADocumentTheTokenizerRefusesIsNamedByItsOffset) {
  write_file(dir_ + "/refuses.model", testing_tokens::kRefusesSpaceX);
  std::string error;
  auto refuses = Tokenizer::load(dir_ + "/refuses.model", &error);
  ASSERT_TRUE(refuses) << error;
  EXPECT_EQ(encode_documents("a\n%\na", *refuses, 1, 2).value(),
            std::vector<int32_t>({1, 0, 2, 1, 3, 2}));  // "a\n" is not a word of it: unk
  const auto ids = encode_documents("a\n%\n x", *refuses, 1, 2);
  ASSERT_FALSE(ids.ok());
  EXPECT_NE(ids.status().message().find("the document at byte 4: the tokenizer cannot encode"),
            std::string::npos)
      << ids.status();
  write_file(dir_ + "/refused/doc.txt", "a\n%\n x");
  auto corpus = list_corpus({dir_ + "/refused"});
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  const auto data = load_token_data(*corpus, *refuses, 0, 1, 2, dir_ + "/cache/tokens.bin", 0.1);
  ASSERT_FALSE(data.ok());
  EXPECT_NE(data.status().message().find("--data: '" + dir_ +
                                         "/refused/doc.txt': the document at byte 4: the "
                                         "tokenizer cannot encode"),
            std::string::npos)
      << data.status();
}

// What inference does with a text (encode_input after the model's BOS) is how training began
// each document; the markers come from the config when it sets them, else from the tokenizer.
TEST_F(DataTest, TextInputsStartAsTrainingDocumentsDo) {
  const std::string doc = "Fortune favours the bold.\n";
  const int bos = resolve_bos_id(-1, tokenizer_.get()), eos = resolve_eos_id(-1, tokenizer_.get());
  EXPECT_EQ(bos, 1);
  EXPECT_EQ(eos, 2);
  const std::vector<int32_t> trained = encode_documents(doc, *tokenizer_, bos, eos).value();
  std::string error;
  const std::vector<int> input = encode_input(*tokenizer_, doc, bos, &error).value();
  ASSERT_EQ(trained.size(), input.size() + 1);
  EXPECT_TRUE(std::equal(input.begin(), input.end(), trained.begin()));
  EXPECT_EQ(encode_input(*tokenizer_, doc, -1, &error).value(),
            std::vector<int>(input.begin() + 1, input.end()));
  EXPECT_EQ(resolve_bos_id(7, tokenizer_.get()), 7);
  EXPECT_EQ(resolve_eos_id(9, tokenizer_.get()), 9);
  EXPECT_EQ(resolve_bos_id(-1, nullptr), -1);
  EXPECT_EQ(resolve_eos_id(-1, nullptr), -1);
}

TEST_F(DataTest, CacheIsReusedUntilAnInputChanges) {
  auto first = load();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_FALSE(first->from_cache);
  EXPECT_EQ(first->files, 2);  // a.dat skipped
  auto second = load();
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->from_cache);
  EXPECT_EQ(second->train, first->train);
  EXPECT_EQ(second->val, first->val);

  write_file(dir_ + "/text/b.txt", testing_trainer::corpus_text(120, 3));  // new size and text
  auto third = load();
  ASSERT_TRUE(third.ok());
  EXPECT_FALSE(third->from_cache);
  EXPECT_NE(third->train.size() + third->val.size(), first->train.size() + first->val.size());

  write_file(dir_ + "/text/c.txt", "another file\n");  // a new file
  auto fourth = load();
  ASSERT_TRUE(fourth.ok());
  EXPECT_FALSE(fourth->from_cache);
  EXPECT_EQ(fourth->files, 3);
}

TEST_F(DataTest, CacheIsRebuiltForAnotherTokenizerOrATouchedFile) {
  ASSERT_TRUE(load().ok());
  auto corpus = list_corpus({dir_ + "/text"});
  ASSERT_TRUE(corpus.ok());
  auto other = load_token_data(*corpus, *tokenizer_, 12345, 1, 2, dir_ + "/cache/tokens.bin", 0.1);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(other->from_cache);
  // Other document markers (a config's bos_id / eos_id) make other ids: not the cached ones.
  auto hash = hash_file(dir_ + "/tok.model");
  ASSERT_TRUE(load().ok());
  auto marked = load_token_data(*corpus, *tokenizer_, *hash, 5, 2, dir_ + "/cache/tokens.bin", 0.1);
  ASSERT_TRUE(marked.ok());
  EXPECT_FALSE(marked->from_cache);
  EXPECT_EQ(marked->train.front(), 5);

  const auto t = fs::last_write_time(dir_ + "/text/a.txt");
  fs::last_write_time(dir_ + "/text/a.txt", t + std::chrono::seconds(5));
  auto touched = list_corpus({dir_ + "/text"});
  ASSERT_TRUE(touched.ok());
  EXPECT_NE(touched->key, corpus->key);
}

TEST_F(DataTest, DamagedCacheIsRebuilt) {
  ASSERT_TRUE(load().ok());
  write_file(dir_ + "/cache/tokens.bin", "CEMLMTOK garbage");
  auto again = load();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->from_cache);
  EXPECT_TRUE(load()->from_cache);
}

// A cache whose header and size still agree but whose contents are damaged is encoded again,
// not trusted: ids outside the vocabulary (they aborted the trainer), per-file counts that wrap
// around 2^64 to the right total (they threw std::length_error), and an id changed into another
// of the vocabulary (it was trained on without a word).
TEST_F(DataTest, CacheWithBadIdsOrCountsIsRebuilt) {
  auto first = load();
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string path = dir_ + "/cache/tokens.bin";
  std::string good, error;
  ASSERT_TRUE(read_file(path, &good, &error)) << error;
  constexpr size_t kCounts = 40;  // magic, version, n_files, corpus key, encoding, content hash
  uint32_t n_files = 0;
  std::memcpy(&n_files, good.data() + 12, 4);
  ASSERT_EQ(n_files, 2u);  // a.txt and b.txt
  std::string bad_id = good;
  const int32_t huge = 0x7fffff00;
  std::memcpy(bad_id.data() + bad_id.size() - 4, &huge, 4);
  std::string bad_counts = good;
  uint64_t counts[2];
  std::memcpy(counts, good.data() + kCounts, sizeof(counts));
  counts[0] += uint64_t(1) << 62, counts[1] -= uint64_t(1) << 62;  // the same sum
  std::memcpy(bad_counts.data() + kCounts, counts, sizeof(counts));
  std::string other_id = good;
  int32_t last = 0;
  std::memcpy(&last, good.data() + good.size() - 4, 4);
  const int32_t other = last == 3 ? 4 : 3;  // both inside the test tokenizer's vocabulary
  std::memcpy(other_id.data() + other_id.size() - 4, &other, 4);
  for (const std::string* damaged : {&bad_id, &bad_counts, &other_id}) {
    write_file(path, *damaged);
    auto again = load();
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_FALSE(again->from_cache);
    EXPECT_EQ(again->train, first->train);
    EXPECT_EQ(again->val, first->val);
    EXPECT_TRUE(load()->from_cache);
  }
}

TEST_F(DataTest, SplitTakesTheEndOfEveryFileAtADocumentStart) {
  auto d = load(0.1);
  ASSERT_TRUE(d.ok());
  const size_t total = d->train.size() + d->val.size();
  EXPECT_NEAR(double(d->val.size()) / double(total), 0.1, 0.01);
  // Each file's tokens end with EOS (2): the last validation token is the last file's EOS.
  EXPECT_EQ(d->val.back(), 2);
  // No document is split between the two: validation starts at a BOS (1), training ends at an EOS.
  EXPECT_EQ(d->val.front(), 1);
  EXPECT_EQ(d->train.back(), 2);
  for (size_t i = 0; i + 1 < d->val.size(); ++i) {
    if (d->val[i] == 2) {
      EXPECT_EQ(d->val[i + 1], 1) << i;  // file b's part follows a's whole
    }
  }
  auto eos_only = load(0.1, -1, 2);  // documents end with EOS and start after one
  ASSERT_TRUE(eos_only.ok());
  EXPECT_EQ(eos_only->train.back(), 2);
  EXPECT_NE(eos_only->val.front(), 2);
  EXPECT_NEAR(double(eos_only->val.size()) / double(eos_only->train.size() + eos_only->val.size()),
              0.1, 0.01);
  auto half = load(0.5);
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(half->train.size() + half->val.size(), total);
  EXPECT_TRUE(std::equal(half->train.begin(), half->train.begin() + 100, d->train.begin()));
}

// Through load_token_data: of a corpus whose files are one document each, training holds every
// file's EOS and validation none, and validation is the asked share.
TEST_F(DataTest, OneDocumentFilesTrainOnTheirEos) {
  const std::string one = fresh_dir();
  for (int f = 0; f < 3; ++f) {
    std::string text = testing_trainer::corpus_text(40, 5 + f);
    for (size_t at = 0; (at = text.find("%\n", at)) != std::string::npos;)
      text.replace(at, 2, "\n");
    write_file(one + "/f" + std::to_string(f) + ".txt", text);
  }
  auto corpus = list_corpus({one});
  ASSERT_TRUE(corpus.ok()) << corpus.status();
  auto hash = hash_file(dir_ + "/tok.model");
  ASSERT_TRUE(hash.ok());
  auto d = load_token_data(*corpus, *tokenizer_, *hash, 1, 2, dir_ + "/one_cache/tokens.bin", 0.1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(std::count(d->train.begin(), d->train.end(), 2), 3);
  EXPECT_EQ(std::count(d->val.begin(), d->val.end(), 2), 0);
  EXPECT_EQ(std::count(d->train.begin(), d->train.end(), 1), 3);  // and every BOS
  EXPECT_EQ(d->train.back(), 2);
  EXPECT_NEAR(double(d->val.size()) / double(d->train.size() + d->val.size()), 0.1, 0.01);
}

// The split moves to the nearest document start, but not beyond half to twice the validation
// size asked for; a BOS that is also the EOS starts a document only after an EOS. With no start in
// range, the file's end through its EOS trains and the ids before it validate.
TEST(Split, MovesToADocumentStartWithinBounds) {
  auto doc = [](int len, std::vector<int32_t>* out) {
    out->push_back(1);
    for (int i = 0; i < len; ++i) out->push_back(7);
    out->push_back(2);
  };
  auto part = [](std::span<const int32_t> ids, double f, int bos, int eos) {
    const ValidationPart v = validation_part(ids, f, bos, eos);
    return std::pair<size_t, size_t>(v.begin, v.end);
  };
  using P = std::pair<size_t, size_t>;
  std::vector<int32_t> ids;
  for (int d = 0; d < 20; ++d) doc(8, &ids);  // 200 tokens, documents every 10
  EXPECT_EQ(part(ids, 0.1, 1, 2), P(180, 200));
  EXPECT_EQ(part(ids, 0.12, 1, 2), P(180, 200));    // cut 176 -> the start at 180
  EXPECT_EQ(part(ids, 0.12, -1, 2), P(180, 200));   // EOS-only markers
  EXPECT_EQ(part(ids, 0.12, -1, -1), P(176, 200));  // no markers: the plain cut
  std::vector<int32_t> two;
  doc(298, &two);
  doc(698, &two);  // documents of 300 and 700 tokens: the start at 300 is far off
  EXPECT_EQ(part(two, 0.05, 1, 2), P(900, 950));  // the last 50 train, the 50 before validate
  // One id for both markers (<|endoftext|>): documents are 2 ids... 2, so a document's last
  // marker is no document start (the old rule took 89 and 99 below).
  std::vector<int32_t> same;
  for (int d = 0; d < 10; ++d) {
    same.push_back(2);
    same.insert(same.end(), 8, 0);
    same.push_back(2);
  }
  EXPECT_EQ(part(same, 0.15, 2, 2), P(80, 100));  // cut 85: starts at 80 and 90, not 89
  EXPECT_EQ(part(same, 0.02, 2, 2), P(96, 98));   // cut 98: no start within bounds
  EXPECT_EQ(part(ids, 0.0, 1, 2), P(200, 200));
}

// A file that is one document gives validation a slice of it and keeps its end, EOS included, in
// training (a corpus of such files otherwise never trained on an EOS); with BOS markers only (no
// EOS to keep) or a short file, what is left to cut.
TEST(Split, AOneDocumentFileKeepsItsEndInTraining) {
  std::vector<int32_t> one = {1};
  one.insert(one.end(), 98, 7);
  one.push_back(2);  // 100 ids
  const ValidationPart v = validation_part(one, 0.1, 1, 2);
  EXPECT_EQ(v.begin, 80u);
  EXPECT_EQ(v.end, 90u);
  const ValidationPart half = validation_part(one, 0.5, 1, 2);  // the head keeps half of the cut
  EXPECT_EQ(half.begin, 25u);
  EXPECT_EQ(half.end, 75u);
  std::vector<int32_t> bos_only(one.begin(), one.end() - 1);  // 99 ids, no EOS
  const ValidationPart b = validation_part(bos_only, 0.1, 1, -1);
  EXPECT_EQ(b.begin, 89u);
  EXPECT_EQ(b.end, 99u);
}

// With at least 1 / val_fraction files cut inside a document (one short document per file), those
// go whole to validation or training (cut, each gave validation a few ids from before its EOS,
// holing every document); fewer are cut as validation_part cuts them, and files with a document
// start near their cut always are.
TEST(Split, ManyOneDocumentFilesGoWhole) {
  auto one_doc = [](int len) {
    std::vector<int32_t> ids = {1};
    ids.insert(ids.end(), size_t(len), 7);
    ids.push_back(2);
    return ids;
  };
  std::vector<std::vector<int32_t>> files;
  for (int i = 0; i < 40; ++i) files.push_back(one_doc(18 + i % 5));
  std::vector<int32_t> many;  // 20 documents of 10 ids: cut at a document start
  for (int d = 0; d < 20; ++d) {
    const auto doc = one_doc(8);
    many.insert(many.end(), doc.begin(), doc.end());
  }
  files.insert(files.begin() + 3, many);
  const std::vector<ValidationPart> parts = validation_parts(files, 0.1, 1, 2);
  ASSERT_EQ(parts.size(), files.size());
  size_t val = 0, total = 0, whole = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const ValidationPart& p = parts[i];
    if (i == 3) {  // its own split, as alone
      EXPECT_EQ(p.begin, validation_part(files[i], 0.1, 1, 2).begin);
      EXPECT_EQ(p.end, files[i].size());
      continue;
    }
    EXPECT_EQ(p.end, files[i].size()) << i;
    EXPECT_TRUE(p.begin == 0 || p.begin == files[i].size()) << i << ": cut at " << p.begin;
    whole += p.begin == 0;
    val += files[i].size() - p.begin;
    total += files[i].size();
  }
  EXPECT_EQ(whole, 4u);  // a tenth of the 40
  EXPECT_NEAR(double(val) / double(total), 0.1, 0.02);
  // Fewer such files than 1 / val_fraction: each is cut as alone.
  files.resize(9);
  for (size_t i = 0; i < files.size(); ++i) {
    const ValidationPart alone = validation_part(files[i], 0.1, 1, 2);
    EXPECT_EQ(validation_parts(files, 0.1, 1, 2)[i].begin, alone.begin) << i;
  }
}

TEST(Windows, SampledWindowsAreSlicesDrawnBySeed) {
  std::vector<int32_t> tokens(100);
  for (int i = 0; i < 100; ++i) tokens[i] = i;
  Rng a(7), b(7);
  std::vector<int> x(3 * 10), y(3 * 10);
  sample_windows(tokens, 10, 3, a, x.data());
  sample_windows(tokens, 10, 3, b, y.data());
  EXPECT_EQ(x, y);
  std::set<int> starts;
  for (int r = 0; r < 3; ++r) {
    for (int j = 1; j < 10; ++j) EXPECT_EQ(x[r * 10 + j], x[r * 10] + j);  // contiguous
    EXPECT_LE(x[r * 10 + 9], 99);
    starts.insert(x[r * 10]);
  }
  EXPECT_GT(starts.size(), 1u);
  std::vector<int> whole(100);
  sample_windows(tokens, 100, 1, a, whole.data());  // the only window
  EXPECT_EQ(whole[0], 0);
}

TEST(Windows, EvalWindowsAreFixedAndSpreadOut) {
  std::vector<int32_t> tokens(100);
  for (int i = 0; i < 100; ++i) tokens[i] = i;
  const auto w = eval_windows(tokens, 10, 4);
  ASSERT_EQ(w.size(), 40u);
  EXPECT_EQ(w[0], 0);
  EXPECT_EQ(w[10], 25);
  EXPECT_EQ(w[30], 75);
  EXPECT_EQ(eval_windows(tokens, 10, 50).size(), 100u);  // at most 10 windows fit
  EXPECT_TRUE(eval_windows(tokens, 101, 4).empty());
}

// A run's own output and cache (and a save's temporary copy of the output) are never its data,
// even when --data names the folder that holds them.
TEST(ListCorpus, LeavesOutTheExcludedDirectories) {
  const std::string dir = fresh_dir();
  write_file(dir + "/a.txt", "some text\n");
  write_file(dir + "/run/train.jsonl", "{\"step\": 1}\n");
  write_file(dir + "/run.tmp-12-0/config.json", "{}\n");
  write_file(dir + "/run.cache/notes.txt", "cached\n");
  write_file(dir + "/runner/b.txt", "more text\n");  // a name that merely starts like it
  auto c = list_corpus({dir}, {dir + "/run/", dir + "/run.cache"});
  ASSERT_TRUE(c.ok()) << c.status();
  std::set<std::string> names;
  for (const std::string& p : c->paths) names.insert(fs::path(p).filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"a.txt", "b.txt"}));
}

// A text file with one stray byte is left out of the data like a .dat index, but unlike one it is
// the user's text: list_corpus says which, and why, for the run to report (it was silent).
TEST(ListCorpus, NamesTheFilesLeftOutForWhatTheyHold) {
  const std::string dir = fresh_dir();
  write_file(dir + "/a.txt", "some text\n");
  write_file(dir + "/latin1.txt", "caf\xe9 au lait\n");
  write_file(dir + "/index.dat", std::string("\0\1binary", 8));
  write_file(dir + "/blob.bin", std::string("ab\0cd", 5));
  auto c = list_corpus({dir});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->skipped.size(), 3u);
  ASSERT_EQ(c->not_text.size(), 2u);  // not index.dat: left out by its name
  EXPECT_NE(c->not_text[0].find("blob.bin"), std::string::npos) << c->not_text[0];
  EXPECT_NE(c->not_text[0].find("NUL byte at offset 2"), std::string::npos) << c->not_text[0];
  EXPECT_NE(c->not_text[1].find("latin1.txt"), std::string::npos) << c->not_text[1];
  EXPECT_NE(c->not_text[1].find("invalid UTF-8 at byte offset 3"), std::string::npos)
      << c->not_text[1];
}

// The run's own files (a checkpoint's weights, the token cache) are binary when --data holds the
// run: they are left out as the run's, not named as text files to convert to UTF-8.
TEST(ListCorpus, NamesNoFileOfTheExcludedDirectoriesAsNotText) {
  const std::string dir = fresh_dir();
  write_file(dir + "/a.txt", "some text\n");
  write_file(dir + "/run/model.safetensors", std::string("\x08\0\0\0weights", 11));
  write_file(dir + "/run.cache/tokens.bin", std::string("ids\0\1", 5));
  write_file(dir + "/latin1.txt", "caf\xe9\n");
  auto c = list_corpus({dir}, {dir + "/run", dir + "/run.cache"});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->not_text.size(), 1u) << absl::StrJoin(c->not_text, "; ");
  EXPECT_NE(c->not_text[0].find("latin1.txt"), std::string::npos) << c->not_text[0];
}

// Another run's checkpoint or token cache under --data is left out and named: their config.json,
// train.jsonl, loss.svg and token keys read as UTF-8 text, and a second run on a folder holding
// the first's output trained on them (62% of its tokens in a review's run). This run's own stay
// left out as its own, unnamed.
TEST(ListCorpus, LeavesOutAndNamesOtherRunsOutput) {
  const std::string dir = fresh_dir();
  write_file(dir + "/a.txt", "some text\n");
  write_file(dir + "/o/config.json", "{}\n");
  write_file(dir + "/o/model.safetensors", "weights");
  write_file(dir + "/o/train.jsonl", "{\"step\": 1}\n");
  write_file(dir + "/o/loss.svg", "<svg/>\n");
  write_file(dir + "/o.cache/tokenizer.key", "1234\n");
  write_file(dir + "/o.cache/tokens.bin", "CEMLMTOK and the rest of a cache");
  write_file(dir + "/p/trainer_state.json", "{}\n");
  write_file(dir + "/mine.cache/tokens.bin", "ids");
  write_file(dir + "/notes/config.json", "{\"a config of the user's data\": 1}\n");
  write_file(dir + "/notes/tokens.bin", "a file of the user's, not a cache\n");
  auto c = list_corpus({dir}, {dir + "/mine", dir + "/mine.cache"});
  ASSERT_TRUE(c.ok()) << c.status();
  std::set<std::string> names;
  for (const std::string& p : c->paths)
    names.insert(fs::path(p).parent_path().filename().string() + "/" +
                 fs::path(p).filename().string());
  EXPECT_EQ(names, (std::set<std::string>{fs::path(dir).filename().string() + "/a.txt",
                                          "notes/config.json", "notes/tokens.bin"}));
  std::set<std::string> runs;
  for (const std::string& d : c->run_dirs) runs.insert(fs::path(d).filename().string());
  EXPECT_EQ(runs, (std::set<std::string>{"o", "o.cache", "p"}));
  // Named itself, one is refused by name (it was walked as a corpus, its JSON read as text).
  for (const char* run : {"/o", "/o.cache", "/p"}) {
    auto named = list_corpus({dir + run}, {});
    EXPECT_EQ(named.status().code(), absl::StatusCode::kNotFound) << run;
    EXPECT_NE(named.status().message().find("--data: input '" + dir + run +
                                            "' is a training run's checkpoint or token cache"),
              std::string::npos)
        << named.status();
  }
}

TEST(ListCorpus, MissingPathNamesTheFlag) {
  auto c = list_corpus({"/nonexistent/cemlm-data"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("--data"), std::string::npos) << c.status();
}

}  // namespace
}  // namespace cemlm
