// UTF-8 validation and corpus collection: strict validity, the skip rules (.dat/.u8, binary,
// non-UTF-8, hidden), sorted deterministic order, and errors that name the path.
#include "cemlm/engine/corpus.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>

#include "cemlm/engine/utf8.h"
#include "test_files.h"

namespace cemlm {
namespace {

using testing_files::fresh_temp_dir;
using testing_files::write_file;

TEST(Utf8, AcceptsWellFormedText) {
  for (const char* s : {"", "plain ascii", "café", "日本", "🎉", "\xEF\xBF\xBD",
                        "\xF4\x8F\xBF\xBF" /* U+10FFFF */, "\xED\x9F\xBF" /* U+D7FF */})
    EXPECT_TRUE(is_valid_utf8(s)) << s;
}

TEST(Utf8, RejectsMalformedBytes) {
  for (const char* s :
       {"\x80", "\xBF", "\xFF", "\xFE", "\xC0\xAF" /* overlong '/' */, "\xC1\xBF", "\xE0\x80\xAF",
        "\xF0\x80\x80\xAF", "\xED\xA0\x80" /* surrogate */, "\xF4\x90\x80\x80" /* above U+10FFFF */,
        "\xF5\x80\x80\x80", "\xE6\x97" /* truncated 日 */, "\xC3", "\xC3(", "\xE6\x97("})
    EXPECT_FALSE(is_valid_utf8(s)) << testing::PrintToString(std::string(s));
}

TEST(Utf8, ValidPrefixPointsAtTheFirstBadByte) {
  EXPECT_EQ(utf8_valid_prefix("ab\xE6\x97"), 2u);
  EXPECT_EQ(utf8_valid_prefix("日x\x80y"), 4u);
  EXPECT_EQ(utf8_valid_prefix("ok"), 2u);
}

// The tail that more bytes can still turn into a character, and only that.
TEST(Utf8, UnfinishedSuffixIsAStartedCharacter) {
  EXPECT_EQ(utf8_unfinished_suffix(""), 0u);
  EXPECT_EQ(utf8_unfinished_suffix("ab"), 0u);
  EXPECT_EQ(utf8_unfinished_suffix("a\xE6"), 1u);  // 日 = E6 97 A5
  EXPECT_EQ(utf8_unfinished_suffix("a\xE6\x97"), 2u);
  EXPECT_EQ(utf8_unfinished_suffix("a\xE6\x97\xA5"), 0u);  // finished
  EXPECT_EQ(utf8_unfinished_suffix("\xF0\x9F\x98"), 3u);   // 😀 = F0 9F 98 80
  EXPECT_EQ(utf8_unfinished_suffix("\xC3"), 1u);
  EXPECT_EQ(utf8_unfinished_suffix("\xFF\xC3"), 1u);  // a bad byte before a started character
  // Bytes that no continuation makes well-formed.
  EXPECT_EQ(utf8_unfinished_suffix("\x80"), 0u);  // a lone continuation byte
  EXPECT_EQ(utf8_unfinished_suffix("\x80\x80\x80\x80"), 0u);
  EXPECT_EQ(utf8_unfinished_suffix("\xFF"), 0u);
  EXPECT_EQ(utf8_unfinished_suffix("\xC0"), 0u);      // overlong lead
  EXPECT_EQ(utf8_unfinished_suffix("\xE0\x80"), 0u);  // overlong: E0 needs A0-BF next
  EXPECT_EQ(utf8_unfinished_suffix("\xED\xA0"), 0u);  // a surrogate
  EXPECT_EQ(utf8_unfinished_suffix("\xF4\x90"), 0u);  // above U+10FFFF
  EXPECT_EQ(utf8_unfinished_suffix("\xE6\x97\xA5\x80"), 0u);
  EXPECT_EQ(utf8_unfinished_suffix("\xE6"
                                   "a"),
            0u);
}

class CorpusTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fresh_temp_dir();
    write_file(dir_ + "/b.txt", "bee\n");
    write_file(dir_ + "/a.txt", "ay\n");
    write_file(dir_ + "/sub/c", "see\n");
    write_file(dir_ + "/sub/c.dat", "index");
    write_file(dir_ + "/sub/c.u8", "see\n");
    write_file(dir_ + "/.hidden/d.txt", "hidden\n");
    write_file(dir_ + "/binary", std::string("ab\0cd", 5));
    write_file(dir_ + "/latin1", "caf\xE9\n");
  }
  std::string dir_;
};

TEST_F(CorpusTest, CollectsSortedTextFilesAndSkipsTheRest) {
  std::vector<std::string> files, skipped;
  std::string error;
  ASSERT_TRUE(collect_text_files({dir_}, &files, &error, &skipped)) << error;
  EXPECT_EQ(files, (std::vector<std::string>{dir_ + "/a.txt", dir_ + "/b.txt", dir_ + "/sub/c"}));
  EXPECT_EQ(skipped, (std::vector<std::string>{dir_ + "/binary", dir_ + "/latin1",
                                               dir_ + "/sub/c.dat", dir_ + "/sub/c.u8"}));
}

// A link to a directory is walked like one (it was left out, and not counted as skipped); a link
// back to a directory being walked is not (a loop), and a file reached by two paths is read once.
TEST_F(CorpusTest, LinkedDirectoriesAreWalkedOnce) {
  namespace fs = std::filesystem;
  write_file(dir_ + "/shared/e.txt", "ee\n");
  fs::create_directory(dir_ + "/top");
  fs::create_directory_symlink(dir_ + "/shared", dir_ + "/top/more");   // another tree
  fs::create_directory_symlink(dir_ + "/top", dir_ + "/top/again");     // a loop
  fs::create_directory_symlink(dir_ + "/shared", dir_ + "/top/twice");  // the same again
  fs::create_symlink(dir_ + "/missing", dir_ + "/top/dangling");
  std::vector<std::string> files, skipped;
  std::string error;
  ASSERT_TRUE(collect_text_files({dir_ + "/top"}, &files, &error, &skipped)) << error;
  EXPECT_EQ(files, std::vector<std::string>{dir_ + "/top/more/e.txt"});
  // A link to nothing is no file to read: skipped, and counted (it was left out unsaid).
  EXPECT_EQ(skipped, std::vector<std::string>{dir_ + "/top/dangling"});
  files.clear();
  ASSERT_TRUE(collect_text_files({dir_}, &files, &error)) << error;
  EXPECT_EQ(files, (std::vector<std::string>{dir_ + "/a.txt", dir_ + "/b.txt",
                                             dir_ + "/shared/e.txt", dir_ + "/sub/c"}));
  // A path skipped by its name does not take the file from its other path (it was lost: the
  // ".u8" path sorted first and counted as the file's one path).
  write_file(dir_ + "/named/art.u8", "art\n");
  fs::create_symlink("art.u8", dir_ + "/named/art2");
  files.clear();
  skipped.clear();
  ASSERT_TRUE(collect_text_files({dir_ + "/named"}, &files, &error, &skipped)) << error;
  EXPECT_EQ(files, std::vector<std::string>{dir_ + "/named/art2"});
  EXPECT_EQ(skipped, std::vector<std::string>{dir_ + "/named/art.u8"});
}

// What a directory holds that is no file to read (a FIFO, a link to a device or to nothing) is
// skipped and counted, with why: it was left out without a word ("0 files skipped"). A FIFO is
// not opened (it would wait for a writer).
TEST_F(CorpusTest, EntriesThatAreNotFilesAreSkippedAndSaidWhy) {
  namespace fs = std::filesystem;
  const std::string d = dir_ + "/odd";
  write_file(d + "/text.txt", "text\n");
  ASSERT_EQ(::mkfifo((d + "/pipe.txt").c_str(), 0644), 0);
  fs::create_symlink("/dev/zero", d + "/zero.txt");
  fs::create_symlink(d + "/missing", d + "/gone.txt");
  fs::create_symlink(d + "/missing", d + "/gone.u8");  // skipped by its name, as a file would be
  write_file(d + "/latin1", "caf\xE9\n");
  std::vector<std::string> files, skipped, why;
  std::string error;
  ASSERT_TRUE(collect_text_files({d}, &files, &error, &skipped, &why)) << error;
  EXPECT_EQ(files, std::vector<std::string>{d + "/text.txt"});
  // After the files skipped for their contents, which a note names first.
  EXPECT_EQ(skipped, (std::vector<std::string>{d + "/latin1", d + "/gone.txt", d + "/gone.u8",
                                               d + "/pipe.txt", d + "/zero.txt"}));
  ASSERT_EQ(why.size(), 5u);
  EXPECT_EQ(why[2], "");
  EXPECT_EQ(why[3], "'" + d +
                        "/pipe.txt' is not a regular file (a FIFO, socket or device, or a "
                        "link to one or to nothing)");
}

TEST_F(CorpusTest, KeepsTheOrderOfExplicitInputs) {
  std::vector<std::string> files;
  std::string error;
  ASSERT_TRUE(collect_text_files(
      {dir_ + "/b.txt", dir_ + "/sub", dir_ + "/a.txt", dir_ + "/sub/c.dat"}, &files, &error))
      << error;
  EXPECT_EQ(files, (std::vector<std::string>{dir_ + "/b.txt", dir_ + "/sub/c", dir_ + "/a.txt"}));
}

TEST_F(CorpusTest, ReadsTheTexts) {
  std::vector<TextFile> files;
  std::string error;
  ASSERT_TRUE(read_corpus({dir_ + "/sub", dir_ + "/a.txt"}, &files, &error)) << error;
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].path, dir_ + "/sub/c");
  EXPECT_EQ(files[0].text, "see\n");
  EXPECT_EQ(files[1].text, "ay\n");
}

// Collecting checks each file a MiB at a time (no file held whole): a character cut by a chunk's
// end is fine, and a file's reason to be skipped is the one a whole read gives: the first bad
// byte's offset, and a NUL anywhere over a bad byte before it. Each case against read_text_file.
TEST_F(CorpusTest, CollectingChecksLargeFilesAsAWholeReadDoes) {
  const size_t mib = size_t(1) << 20;
  const std::string big = fresh_temp_dir();
  const std::string fill(mib - 1, 'a');  // 日 (3 bytes) then straddles the first MiB's end
  const struct {
    std::string name, bytes, why;
  } cases[] = {{"straddling", fill + "日" + std::string(mib, 'b') + "é", ""},
               {"bad_late", fill + "日" + std::string(mib, 'b') + "\xFF" + "c",
                "offset " + std::to_string(2 * mib + 2)},
               {"cut_at_end", fill + "\xE6\x97", "offset " + std::to_string(mib - 1)},
               {"nul_after_bad", "x\xFF" + std::string(2 * mib, 'c') + std::string(1, '\0'),
                "NUL byte at offset " + std::to_string(2 * mib + 2)}};
  for (const auto& c : cases) write_file(big + "/" + c.name, c.bytes);
  std::vector<std::string> files, skipped, why;
  std::string error;
  ASSERT_TRUE(collect_text_files({big}, &files, &error, &skipped, &why)) << error;
  EXPECT_EQ(files, (std::vector<std::string>{big + "/straddling"}));
  ASSERT_EQ(skipped.size(), 3u);
  for (size_t i = 0; i < skipped.size(); ++i) {
    const auto& c = *std::find_if(std::begin(cases), std::end(cases),
                                  [&](const auto& k) { return big + "/" + k.name == skipped[i]; });
    SCOPED_TRACE(c.name);
    EXPECT_NE(why[i].find(c.why), std::string::npos) << why[i];
    std::string text, whole;
    EXPECT_FALSE(read_text_file(skipped[i], &text, &whole));
    EXPECT_EQ(whole, why[i]);
  }
}

TEST_F(CorpusTest, ErrorsNameThePath) {
  std::vector<std::string> files;
  std::string error;
  EXPECT_FALSE(collect_text_files({dir_ + "/a.txt", dir_ + "/missing"}, &files, &error));
  EXPECT_NE(error.find(dir_ + "/missing"), std::string::npos) << error;
  std::string text;
  EXPECT_FALSE(read_text_file(dir_ + "/latin1", &text, &error));
  EXPECT_NE(error.find(dir_ + "/latin1"), std::string::npos) << error;
  EXPECT_NE(error.find("offset 3"), std::string::npos) << error;
  EXPECT_FALSE(read_text_file(dir_ + "/binary", &text, &error));
  EXPECT_NE(error.find("NUL byte at offset 2"), std::string::npos) << error;
  EXPECT_FALSE(read_file(dir_ + "/sub", &text, &error));
  EXPECT_NE(error.find(dir_ + "/sub"), std::string::npos) << error;
  // A loop of links is no missing file: said as what it is.
  std::filesystem::create_symlink(dir_ + "/loop_b", dir_ + "/loop_a");
  std::filesystem::create_symlink(dir_ + "/loop_a", dir_ + "/loop_b");
  EXPECT_FALSE(collect_text_files({dir_ + "/loop_a"}, &files, &error));
  EXPECT_NE(error.find("input '" + dir_ +
                       "/loop_a' cannot be looked up: Too many levels of "
                       "symbolic links"),
            std::string::npos)
      << error;
  EXPECT_FALSE(read_file(dir_ + "/loop_a", &text, &error));
  EXPECT_NE(error.find("'" + dir_ + "/loop_a' cannot be looked up"), std::string::npos) << error;
  EXPECT_FALSE(collect_text_files({dir_ + "/missing"}, &files, &error));
  EXPECT_NE(error.find("' does not exist"), std::string::npos) << error;
}

TEST(Corpus, FortunesDirectoryYieldsOnlyTextFiles) {
  std::vector<std::string> files, skipped;
  std::string error;
  ASSERT_TRUE(collect_text_files({testing_files::kFortunes}, &files, &error, &skipped)) << error;
  ASSERT_GE(files.size(), 10u) << "is the Debian fortunes package installed?";
  EXPECT_TRUE(std::is_sorted(files.begin(), files.end()));
  for (const auto& f : files) {
    EXPECT_FALSE(f.ends_with(".dat")) << f;
    EXPECT_FALSE(f.ends_with(".u8")) << f;
  }
  EXPECT_GE(skipped.size(), files.size());  // every text file has its .dat index and .u8 link
}

}  // namespace
}  // namespace cemlm
