// safetensors: F32 round trip, BF16/F16 conversion against hand-written bytes, and every kind of
// malformed file refused with a message naming the tensor (or "header").
#include "cemlm/engine/safetensors.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cemlm/engine/crc32c.h"
#include "io_test_util.h"

namespace cemlm {
namespace {

using testing_io::fresh_dir;
using testing_io::list_dir;
using testing_io::raw;
using testing_io::read_bytes;
using testing_io::safetensors_bytes;
using testing_io::write_bytes;

TEST(Safetensors, RoundTripIsBitExact) {
  const std::string dir = fresh_dir(), path = dir + "/t.safetensors";
  std::vector<float> a = {1.5f, -0.0f, 3e-39f, std::numeric_limits<float>::max(), 7.0f, -2.25f};
  std::vector<float> b = {42.0f};
  ASSERT_TRUE(write_safetensors(path, {{"a", {2, 3}, a}, {"b", {1}, b}, {"empty", {0, 4}, {}}},
                                {{"note", "hello"}})
                  .ok());
  const std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "body should start 8-byte aligned";

  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors().size(), 3u);
  EXPECT_EQ(f->tensors()[0].name, "a");  // body order = write order
  EXPECT_EQ(f->find("a")->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f->find("a")->dtype, DType::kF32);
  EXPECT_EQ(f->metadata().at("note"), "hello");
  auto got = f->read_f32("a");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(std::memcmp(got->data(), a.data(), a.size() * 4), 0);
  EXPECT_EQ(*f->read_f32("b"), b);
  EXPECT_TRUE(f->read_f32("empty")->empty());
  EXPECT_FALSE(f->read_f32("nope").ok());
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"t.safetensors"}) << "temporary file left";
}

TEST(Crc32c, GivesTheStandardCheckValueWholeOrInParts) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32c(text.data(), text.size()), 0xE3069283u);  // RFC 3720's check value
  EXPECT_EQ(crc32c(text.data(), 0), 0u);
  // 32 zero bytes and 32 0xFF bytes: RFC 3720 B.4's examples.
  EXPECT_EQ(crc32c(std::string(32, '\0').data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xFF').data(), 32), 0x62A8AB43u);
  std::string long_text;
  for (int i = 0; i < 1000; ++i) long_text += char(i * 37 + (i >> 3));
  const uint32_t whole = crc32c(long_text.data(), long_text.size());
  for (size_t cut : {size_t(1), size_t(7), size_t(8), size_t(500), size_t(999)})
    EXPECT_EQ(crc32c(long_text.data() + cut, long_text.size() - cut, crc32c(long_text.data(), cut)),
              whole)
        << cut;
  // The table, which CPUs without SSE4.2 run, gives the same from any start and length.
  EXPECT_EQ(crc32c_portable(text.data(), text.size()), 0xE3069283u);
  for (size_t start : {size_t(0), size_t(3)})
    for (size_t n : {size_t(0), size_t(5), size_t(8), size_t(13), size_t(997)})
      EXPECT_EQ(crc32c_portable(long_text.data() + start, n, 0x1234u),
                crc32c(long_text.data() + start, n, 0x1234u))
          << start << " " << n;
}

// The writer puts the body's CRC-32C in the metadata, and open() refuses a body that does not
// match it: a flipped bit in a weight (1e-3 read as 1e35) was served, or resumed from, silently.
TEST(Safetensors, ABodyThatDoesNotMatchItsChecksumIsRefused) {
  const std::string dir = fresh_dir(), path = dir + "/t.safetensors";
  const std::vector<float> a = {1e-3f, -2.0f, 0.5f}, b = {42.0f};
  ASSERT_TRUE(write_safetensors(path, {{"a", {3}, a}, {"b", {1}, b}}, {{"note", "x"}}).ok());
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  std::string body_bytes(reinterpret_cast<const char*>(a.data()), 12);
  body_bytes.append(reinterpret_cast<const char*>(b.data()), 4);
  char want[9];
  std::snprintf(want, sizeof want, "%08x", crc32c(body_bytes.data(), body_bytes.size()));
  EXPECT_EQ(f->metadata().at(kChecksumKey), want);
  const std::string good = read_bytes(path);
  for (size_t from_end : {size_t(1), size_t(9), size_t(16)}) {  // a bit of b, of a, a's first
    std::string bad = good;
    bad[bad.size() - from_end] ^= 0x40;  // an exponent bit of a little-endian float
    write_bytes(path, bad);
    auto damaged = SafetensorsFile::open(path);
    ASSERT_FALSE(damaged.ok()) << from_end;
    EXPECT_TRUE(absl::IsDataLoss(damaged.status())) << damaged.status();
    EXPECT_NE(damaged.status().message().find(
                  "is damaged: its tensors' bytes do not match the CRC-32C written with them "
                  "(crc32c " +
                  std::string(want)),
              std::string::npos)
        << damaged.status();
  }
  // Rewritten by another program that kept the metadata (HF's writer orders tensors by name;
  // a conversion changes their dtype): the checksum is of other bytes, and not held against it.
  {
    ASSERT_TRUE(write_safetensors(path, {{"a", {3}, a}, {"b", {1}, b}}).ok());
    auto ours = SafetensorsFile::open(path);
    ASSERT_TRUE(ours.ok()) << ours.status();
    const std::string meta =
        absl::StrCat(R"("__metadata__":{"crc32c":")", ours->metadata().at(kChecksumKey),
                     R"(","crc32c_layout":")", ours->metadata().at(kLayoutChecksumKey), R"("})");
    const std::string b_first =
        safetensors_bytes("{" + meta +
                              R"(,"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("a":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}})",
                          std::string(reinterpret_cast<const char*>(b.data()), 4) +
                              std::string(reinterpret_cast<const char*>(a.data()), 12));
    write_bytes(path, b_first);
    auto rewritten = SafetensorsFile::open(path);
    ASSERT_TRUE(rewritten.ok()) << rewritten.status();
    EXPECT_EQ(*rewritten->read_f32("a"), a);
  }
  // A file of another writer has no checksum and is read as it is; one whose checksum is no
  // CRC is refused by name.
  write_bytes(path, safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                      std::string(4, '\0')));
  EXPECT_TRUE(SafetensorsFile::open(path).ok());
  // Eight characters that a hex parser takes but are not 8 digits: a sign, "0x", spaces (escaped
  // in the message; they were reported as a mismatch, line ends and all).
  for (const auto& [crc, shown] : {std::pair<std::string, std::string>{"12345", "12345"},
                                   {"+1234567", "+1234567"},
                                   {"0x123456", "0x123456"},
                                   {"\\r\\n\\t123\\r\\n", "\\r\\n\\t123\\r\\n"}}) {
    write_bytes(path,
                safetensors_bytes(R"({"__metadata__":{"crc32c":")" + crc +
                                      R"("},)"
                                      R"("w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                  std::string(4, '\0')));
    auto bad_key = SafetensorsFile::open(path);
    ASSERT_FALSE(bad_key.ok()) << crc;
    EXPECT_NE(bad_key.status().message().find("header: __metadata__.crc32c \"" + shown +
                                              "\" is not 8 hex digits (a CRC-32C)"),
              std::string::npos)
        << bad_key.status();
  }
  // A caller's own crc32c entry is replaced by the body's.
  ASSERT_TRUE(write_safetensors(path, {{"a", {3}, a}, {"b", {1}, b}}, {{kChecksumKey, "0"}}).ok());
  auto rewritten = SafetensorsFile::open(path);
  ASSERT_TRUE(rewritten.ok()) << rewritten.status();
  EXPECT_EQ(rewritten->metadata().at(kChecksumKey), want);
}

TEST(Safetensors, MovedFileStaysReadable) {
  const std::string path = fresh_dir() + "/t.safetensors";
  std::vector<float> a = {1, 2, 3};
  ASSERT_TRUE(write_safetensors(path, {{"a", {3}, a}}).ok());
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok());
  SafetensorsFile moved = std::move(*f);
  EXPECT_EQ(*moved.read_f32("a"), a);
}

TEST(Safetensors, Bf16ConvertsExactly) {
  const std::string path = fresh_dir() + "/t.safetensors";
  std::vector<uint16_t> bits = {0x3F80, 0xC000, 0x3F00, 0x4049, 0x0000, 0x8000};
  write_bytes(path,
              safetensors_bytes(R"({"x":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]}})",
                                raw(bits)));
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  auto v = f->read_f32("x");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, (std::vector<float>{1.0f, -2.0f, 0.5f, 3.140625f, 0.0f, -0.0f}));
  EXPECT_TRUE(std::signbit((*v)[5]));
}

// A half-precision tensor longer than one part of the reads (2^18 values) converts whole.
TEST(Safetensors, LongBf16TensorConvertsAcrossReads) {
  const std::string path = fresh_dir() + "/t.safetensors";
  constexpr size_t kCount = 300'007;
  std::vector<uint16_t> bits(kCount);
  for (size_t i = 0; i < kCount; ++i) bits[i] = uint16_t(0x3F80 + i % 128);  // 1 + (i % 128) / 128
  write_bytes(path,
              safetensors_bytes(R"({"x":{"dtype":"BF16","shape":[300007],"data_offsets":[0,)" +
                                    std::to_string(2 * kCount) + "]}}",
                                raw(bits)));
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  auto v = f->read_f32("x");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->size(), kCount);
  for (size_t i = 0; i < kCount; ++i)
    ASSERT_EQ((*v)[i], 1.0f + float(i % 128) / 128.0f) << "value " << i;
}

// A file cut short after it was opened (a copy over a checkpoint while a server loads it) is an
// error naming it; reading a mapping of it past its new end killed the process with SIGBUS.
TEST(Safetensors, AFileCutShortWhileOpenIsAnError) {
  const std::string path = fresh_dir() + "/t.safetensors";
  const std::vector<float> a(100'000, 0.5f), b(10, 2.0f);
  ASSERT_TRUE(write_safetensors(path, {{"a", {100'000}, a}, {"b", {10}, b}}).ok());
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  for (const char* name : {"a", "b"}) {
    auto v = f->read_f32(name);
    ASSERT_FALSE(v.ok()) << name;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << v.status();
    EXPECT_NE(v.status().message().find(path), std::string::npos) << v.status();
    EXPECT_NE(v.status().message().find("changed while it was read"), std::string::npos)
        << v.status();
  }
}

// Bytes written over the file in place after open checked its CRC (a copy over a checkpoint while
// a server loads it, at the same size) are an error, not weights that mix two files unchecked; the
// file only unlinked (a save replacing the checkpoint it was in) still reads.
TEST(Safetensors, AFileWrittenToWhileOpenIsAnError) {
  const std::string dir = fresh_dir(), path = dir + "/t.safetensors";
  const std::vector<float> a(1000, 0.5f), b(10, 2.0f);
  ASSERT_TRUE(write_safetensors(path, {{"a", {1000}, a}, {"b", {10}, b}}).ok());
  // Written long ago, as a served checkpoint is: the write below cannot share its time.
  const struct timespec old[2] = {{1'000'000'000, 0}, {1'000'000'000, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), old, 0), 0);
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(f->read_f32("a").ok());
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const float x = 123.0f;
  ASSERT_EQ(::pwrite(fd, &x, 4, off_t(std::filesystem::file_size(path) - 4)), 4);  // b's last
  ::close(fd);
  for (const char* name : {"a", "b"}) {
    auto v = f->read_f32(name);
    ASSERT_FALSE(v.ok()) << name << " read " << (*v)[0];
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDataLoss) << v.status();
    EXPECT_NE(v.status().message().find(path), std::string::npos) << v.status();
    EXPECT_NE(v.status().message().find("written to while it was read"), std::string::npos)
        << v.status();
  }
  ASSERT_TRUE(write_safetensors(path, {{"a", {1000}, a}, {"b", {10}, b}}).ok());
  auto g = SafetensorsFile::open(path);
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(::unlink(path.c_str()), 0);
  EXPECT_EQ(*g->read_f32("a"), a);
  EXPECT_EQ(*g->read_f32("b"), b);
}

TEST(Safetensors, F16ConvertsExactly) {
  const std::string path = fresh_dir() + "/t.safetensors";
  // 1, -2, 0.5, max normal, smallest subnormal, smallest normal, -0, 1/3 rounded.
  std::vector<uint16_t> bits = {0x3C00, 0xC000, 0x3800, 0x7BFF, 0x0001, 0x0400, 0x8000, 0x3555};
  write_bytes(path, safetensors_bytes(R"({"x":{"dtype":"F16","shape":[8],"data_offsets":[0,16]}})",
                                      raw(bits)));
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  auto v = f->read_f32("x");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, (std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f, std::ldexp(1.0f, -24),
                                    std::ldexp(1.0f, -14), -0.0f, 0.333251953125f}));
  EXPECT_TRUE(std::signbit((*v)[6]));
}

struct BadFile {
  const char* what;
  std::string bytes;
  const char* expect;  // must appear in the error
};

std::string body(size_t n) { return std::string(n, '\0'); }
std::string one(const std::string& entry, const std::string& data) {
  return safetensors_bytes("{\"w\":" + entry + "}", data);
}

std::vector<BadFile> bad_files() {
  std::string huge_len(8, '\0');
  huge_len[0] = char(0xff);
  huge_len[1] = char(0x7f);
  return {
      {"shorter than the length", "abc", "header"},
      {"length beyond file", huge_len + "{}", "header"},
      {"length beyond file by one", safetensors_bytes("{}", "").substr(0, 9), "header"},
      {"not JSON", safetensors_bytes("{\"w\":", ""), "header"},
      {"not an object", safetensors_bytes("[1,2]", ""), "header"},
      {"metadata not strings", safetensors_bytes(R"({"__metadata__":{"k":1}})", ""),
       "__metadata__"},
      {"metadata key with a newline", safetensors_bytes(R"({"__metadata__":{"k\n":1}})", ""),
       "'__metadata__.k\\n' must be a string"},
      {"unknown dtype", one(R"({"dtype":"I64","shape":[1],"data_offsets":[0,8]})", body(8)), "'w'"},
      // The dtype is quoted escaped (a right-to-left override went into the message as it was).
      {"dtype with a right-to-left override",
       one("{\"dtype\":\"F\xe2\x80\xae"
           "32\",\"shape\":[1],\"data_offsets\":[0,4]}",
           body(4)),
       "dtype \"F\\u202e32\" is not supported"},
      {"entry not an object", one("[]", ""), "'w'"},
      // A name is escaped in the error: a newline would forge a log line.
      {"name with a newline",
       safetensors_bytes(R"({"a\nb":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", body(8)),
       "tensor 'a\\nb': "},
      {"no data_offsets", one(R"({"dtype":"F32","shape":[1]})", body(4)), "'w'"},
      {"negative dim", one(R"({"dtype":"F32","shape":[-1],"data_offsets":[0,4]})", body(4)), "'w'"},
      {"shape not array", one(R"({"dtype":"F32","shape":2,"data_offsets":[0,8]})", body(8)), "'w'"},
      {"offsets too short for shape",
       one(R"({"dtype":"F32","shape":[2,2],"data_offsets":[0,12]})", body(12)), "'w'"},
      {"offsets too long for dtype",
       one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,8]})", body(8)), "'w'"},
      {"offsets reversed", one(R"({"dtype":"F32","shape":[0],"data_offsets":[8,4]})", body(8)),
       "'w'"},
      {"offsets not a pair", one(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})", body(4)),
       "'w'"},
      {"truncated body", one(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})", body(12)),
       "'w'"},
      {"overlap",
       safetensors_bytes(R"({"v":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                         body(12)),
       "'w'"},
      // A tensor named twice: "last one wins" would silently drop one of them.
      {"duplicate tensor",
       safetensors_bytes(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                         body(8)),
       "header: duplicate key \"w\""},
      {"duplicate metadata key",
       safetensors_bytes(R"({"__metadata__":{"format":"pt","format":"np"}})", ""),
       "duplicate key \"__metadata__.format\""},
      {"syntax error position", safetensors_bytes("{\"w\" 1}", ""), "line 1, column 6"},
      {"bad first byte", safetensors_bytes("#\n{}", ""), "header does not start with '{'"},
      // Other readers refuse what the JSON parser alone skipped before the '{'.
      {"byte-order mark", safetensors_bytes("\xEF\xBB\xBF{}", ""),
       "header does not start with '{'"},
      {"space first", safetensors_bytes(" {}", ""), "header does not start with '{'"},
      // The JSON parser alone stops at a NUL: the tensor after it was dropped without a word.
      {"NUL inside the header", safetensors_bytes(std::string("{}\0{\"w\":{}}", 11), ""),
       "header: not valid JSON at line 1, column 3 (byte 2): a NUL byte"},
      // The body must be the tensors back to back: a gap or trailing bytes mean a header that
      // does not describe the file.
      {"trailing bytes", one(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})", body(5)),
       "describe 4 bytes of data but 5 follow"},
      {"data before the first tensor",
       one(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})", body(8)), "'w'"},
      {"gap between tensors",
       safetensors_bytes(R"({"v":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("w":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                         body(12)),
       "'w'"},
      {"body without tensors", safetensors_bytes("{}", body(4)), "describe 0 bytes"},
      // A deep header cost memory quadratic in its depth before it was refused.
      {"nested too deep",
       one(R"({"dtype":)" + std::string(1000, '[') + std::string(1000, ']') +
               R"(,"shape":[1],"data_offsets":[0,4]})",
           body(4)),
       "header: not valid JSON at line 1, column 77 (byte 76): nested more than 64"},
  };
}

TEST(Safetensors, MalformedFilesAreRefusedByName) {
  const std::string dir = fresh_dir();
  for (const BadFile& b : bad_files()) {
    const std::string path = dir + "/bad.safetensors";
    write_bytes(path, b.bytes);
    auto f = SafetensorsFile::open(path);
    ASSERT_FALSE(f.ok()) << b.what;
    EXPECT_NE(f.status().message().find(b.expect), std::string::npos)
        << b.what << ": " << f.status().message();
  }
}

// A directory in place of the file was "cannot map: No such device", and a FIFO (no writer) hung
// the open for good: anything but a regular file is refused, without blocking.
TEST(Safetensors, NonRegularFilesAreRefused) {
  const std::string dir = fresh_dir();
  std::filesystem::create_directory(dir + "/d.safetensors");
  ASSERT_EQ(::mkfifo((dir + "/f.safetensors").c_str(), 0600), 0);
  for (const char* name : {"/d.safetensors", "/f.safetensors"}) {
    auto f = SafetensorsFile::open(dir + name);
    ASSERT_FALSE(f.ok()) << name;
    EXPECT_TRUE(absl::IsInvalidArgument(f.status())) << f.status();
    EXPECT_NE(f.status().message().find("not a safetensors file"), std::string::npos) << f.status();
  }
  auto f = SafetensorsFile::open(dir + "/d.safetensors");
  EXPECT_NE(f.status().message().find("is a directory"), std::string::npos) << f.status();
}

// A header length over the format's 100 MiB limit was reported as "beyond the end of the file"
// even when the file is that long.
TEST(Safetensors, HeaderOverTheLimitIsSaidSo) {
  const std::string path = fresh_dir() + "/big.safetensors";
  const uint64_t n = (uint64_t(100) << 20) + 8;
  std::string len(8, '\0');
  std::memcpy(len.data(), &n, 8);
  write_bytes(path, len);
  std::filesystem::resize_file(path, 8 + n);  // sparse: no disk used
  auto f = SafetensorsFile::open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("over the format's limit of 104857600 bytes"),
            std::string::npos)
      << f.status();
}

TEST(Safetensors, NonFiniteValuesAreRefusedByName) {
  const std::string path = fresh_dir() + "/t.safetensors";
  const std::vector<float> f32 = {1.0f, std::nanf("")};
  const std::vector<uint16_t> f16_inf = {0x3C00, 0x7C00}, bf16_nan = {0x7FC0};
  write_bytes(path, safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                      R"("b":{"dtype":"F16","shape":[2],"data_offsets":[8,12]},)"
                                      R"("c":{"dtype":"BF16","shape":[1],"data_offsets":[12,14]}})",
                                      raw(f32) + raw(f16_inf) + raw(bf16_nan)));
  auto f = SafetensorsFile::open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  for (const char* name : {"a", "b", "c"}) {
    auto v = f->read_f32(name);
    ASSERT_FALSE(v.ok()) << name;
    EXPECT_NE(v.status().message().find(std::string("'") + name + "'"), std::string::npos)
        << v.status().message();
  }
}

TEST(Safetensors, WriterRefusesBadTensorsByName) {
  const std::string dir = fresh_dir(), path = dir + "/t.safetensors";
  std::vector<float> three = {1, 2, 3};
  auto st = write_safetensors(path, {{"short", {2, 2}, three}});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'short'"), std::string::npos) << st.message();
  st = write_safetensors(path, {{"dup", {3}, three}, {"dup", {3}, three}});
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'dup'"), std::string::npos) << st.message();
  EXPECT_TRUE(list_dir(dir).empty());
}

TEST(Safetensors, FailedAtomicWriteKeepsTheOldFile) {
  const std::string dir = fresh_dir(), path = dir + "/state.json";
  write_bytes(path, "old");
  auto st = write_file_atomic(path, [](std::FILE* f) {
    std::fputs("half of the new", f);
    return absl::InternalError("simulated failure");
  });
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(read_bytes(path), "old");
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"state.json"});
  ASSERT_TRUE(write_file_atomic(path, [](std::FILE* f) {
                std::fputs("new", f);
                return absl::OkStatus();
              }).ok());
  EXPECT_EQ(read_bytes(path), "new");
}

// A link is written through (the link was replaced by a file, its target left as it was), and a
// FIFO or a device is refused (renamed over, it became a plain file: /dev/null too, as root).
TEST(Safetensors, AtomicWriteGoesThroughALinkAndRefusesAFifo) {
  const std::string dir = fresh_dir();
  auto write = [](const std::string& path, const char* text) {
    return write_file_atomic(path, [text](std::FILE* f) {
      std::fputs(text, f);
      return absl::OkStatus();
    });
  };
  write_bytes(dir + "/real.json", "old");
  std::filesystem::create_symlink("real.json", dir + "/link.json");
  ASSERT_TRUE(write(dir + "/link.json", "new").ok());
  EXPECT_TRUE(std::filesystem::is_symlink(dir + "/link.json"));
  EXPECT_EQ(read_bytes(dir + "/real.json"), "new");
  ASSERT_EQ(::mkfifo((dir + "/fifo").c_str(), 0600), 0);
  const absl::Status st = write(dir + "/fifo", "x");
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("'" + dir + "/fifo' exists and is not a regular file"),
            std::string::npos)
      << st;
  EXPECT_TRUE(std::filesystem::is_fifo(dir + "/fifo"));
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{"fifo", "link.json", "real.json"}));
}

}  // namespace
}  // namespace cemlm
