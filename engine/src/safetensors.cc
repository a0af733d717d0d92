// safetensors reader (mmap, header validation, F32/BF16/F16 → F32) and atomic F32 writer.
// The header is checked whole at open so that a bad file fails before any tensor is used.
#include "cemlm/engine/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <string_view>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "cemlm/engine/crc32c.h"
#include "cemlm/engine/status.h"
#include "cemlm/engine/strict_json.h"
#include "cemlm/kernels/bf16.h"
#include "nlohmann/json.hpp"

namespace cemlm {

static_assert(std::endian::native == std::endian::little,
              "safetensors is little-endian; a big-endian host needs byte swapping");

namespace {

using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100u << 20;  // the format's own limit

size_t dtype_size(DType d) { return d == DType::kF32 ? 4 : 2; }

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
  const float sub = std::ldexp(float(man), -24);  // subnormal (or zero)
  return sign ? -sub : sub;
}

absl::Status header_error(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": header: ", what));
}
absl::Status tensor_error(const std::string& path, const std::string& name,
                          const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": tensor '", absl::CHexEscape(name), "': ", what));
}

absl::StatusOr<DType> parse_dtype(const json& v) {
  if (v.is_string()) {
    const std::string s = v.get<std::string>();
    if (s == "F32") return DType::kF32;
    if (s == "F16") return DType::kF16;
    if (s == "BF16") return DType::kBF16;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype ", v.dump(-1, ' ', /*ensure_ascii=*/true),
                   " is not supported (convert the file to F32, BF16 or F16)"));
}

// numel × dtype size in bytes, or an error on negative dims or overflow.
absl::StatusOr<uint64_t> parse_shape(const json& v, DType dtype, std::vector<int64_t>* shape) {
  if (!v.is_array()) return absl::InvalidArgumentError("'shape' must be an array of integers");
  uint64_t bytes = dtype_size(dtype);
  for (const json& d : v) {
    if (!d.is_number_unsigned())
      return absl::InvalidArgumentError("'shape' must hold non-negative integers");
    const uint64_t x = d.get<uint64_t>();
    if (x > (uint64_t(1) << 40) || __builtin_mul_overflow(bytes, x, &bytes))
      return absl::InvalidArgumentError(absl::StrCat("'shape' ", v.dump(), " is too large"));
    shape->push_back(int64_t(x));
  }
  return bytes;
}

absl::Status parse_entry(const json& v, uint64_t body_size, TensorInfo* t) {
  if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
    return absl::InvalidArgumentError("entry must be an object with dtype, shape, data_offsets");
  CEMLM_ASSIGN_OR_RETURN(t->dtype, parse_dtype(v["dtype"]));
  CEMLM_ASSIGN_OR_RETURN(uint64_t bytes, parse_shape(v["shape"], t->dtype, &t->shape));
  const json& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    return absl::InvalidArgumentError("'data_offsets' must be [begin, end] with integers >= 0");
  t->begin = off[0].get<uint64_t>();
  t->end = off[1].get<uint64_t>();
  if (t->begin > t->end)
    return absl::InvalidArgumentError(
        absl::StrCat("data_offsets [", t->begin, ", ", t->end, "] end before they begin"));
  if (t->end - t->begin != bytes)
    return absl::InvalidArgumentError(absl::StrCat(
        "data_offsets [", t->begin, ", ", t->end, "] hold ", t->end - t->begin, " bytes but shape ",
        shape_string(t->shape), " of ", dtype_name(t->dtype), " needs ", bytes));
  if (t->end > body_size)
    return absl::InvalidArgumentError(absl::StrCat("data_offsets [", t->begin, ", ", t->end,
                                                   "] reach past the end of the data (", body_size,
                                                   " bytes): the file is truncated"));
  return absl::OkStatus();
}

absl::Status parse_metadata(const json& v, std::map<std::string, std::string>* out) {
  if (!v.is_object()) return absl::InvalidArgumentError("'__metadata__' must be an object");
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!it.value().is_string())
      return absl::InvalidArgumentError(
          absl::StrCat("'__metadata__.", absl::CHexEscape(it.key()), "' must be a string"));
    (*out)[it.key()] = it.value().get<std::string>();
  }
  return absl::OkStatus();
}

absl::Status errno_error(const std::string& what, const std::string& path) {
  return absl::UnavailableError(
      absl::StrCat("cannot ", what, " '", path, "': ", std::strerror(errno)));
}

// Reads `bytes` bytes at `offset` of the file, all of them or an error: a file cut short since it
// was opened (overwritten in place while a model loads) is an error naming it, where reading a
// mapping of it past its new end killed the process with SIGBUS.
absl::Status read_at(int fd, const std::string& path, uint64_t offset, void* out, size_t bytes) {
  auto* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t got = ::pread(fd, p, bytes, off_t(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return errno_error("read", path);
    if (got == 0)
      return absl::DataLossError(absl::StrCat(
          "'", path, "' ends at byte ", offset,
          ", short of what it held when it was opened: it changed while it was read (a copy "
          "over it?); load it again once it is written whole"));
    p += got;
    offset += uint64_t(got);
    bytes -= size_t(got);
  }
  return absl::OkStatus();
}

int64_t nanoseconds(const struct timespec& t) {
  return int64_t(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

}  // namespace

const char* dtype_name(DType d) {
  return d == DType::kF32 ? "F32" : d == DType::kF16 ? "F16" : "BF16";
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

absl::Status write_file_atomic(const std::string& path_given,
                               const std::function<absl::Status(std::FILE*)>& fill) {
  // Through a symbolic link, its target is replaced and the link kept (the rename replaced the
  // link). Anything but a regular file is refused: renamed over, a device (/dev/null, as root)
  // or a FIFO would have become a plain file.
  std::string path = path_given;
  std::error_code ec;
  if (std::filesystem::is_symlink(path, ec))
    if (const std::filesystem::path target = std::filesystem::weakly_canonical(path, ec); !ec)
      path = target.string();
  if (const std::filesystem::file_status st = std::filesystem::status(path, ec);
      std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    return absl::FailedPreconditionError(absl::StrCat(
        "'", path_given,
        "' exists and is not a regular file (a directory, a device such as "
        "/dev/null, a pipe or a socket), which a write would replace; name a file to write"));
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter++);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return errno_error("create", tmp);
  absl::Status st = fill(f);
  if (st.ok() && (std::fflush(f) != 0 || ::fsync(fileno(f)) != 0)) st = errno_error("write", tmp);
  if (std::fclose(f) != 0 && st.ok()) st = errno_error("write", tmp);
  if (st.ok() && std::rename(tmp.c_str(), path.c_str()) != 0) st = errno_error("rename onto", path);
  if (!st.ok()) std::remove(tmp.c_str());
  return st;
}

namespace {

// The CRC-32C of a file's tensor entries in body order (name, dtype, shape, offsets): tells a
// file as its writer laid it out from one another program rewrote.
uint32_t layout_crc(const std::vector<TensorInfo>& tensors) {
  std::string text;
  for (const TensorInfo& t : tensors)
    text += t.name + '\0' +
            absl::StrCat(dtype_name(t.dtype), " ", shape_string(t.shape), " ", t.begin, " ", t.end,
                         "\n");
  return crc32c(text.data(), text.size());
}

}  // namespace

absl::Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  header["__metadata__"] = nullptr;  // first, filled once the layout is known
  std::vector<TensorInfo> layout;
  uint32_t crc = 0;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const NamedTensor& t : tensors) {
    int64_t numel = 1;
    for (int64_t s : t.shape) numel *= s;
    if (t.name == "__metadata__" || !names.insert(t.name).second)
      return tensor_error(path, t.name, "name is reserved or used twice");
    if (int64_t(t.data.size()) != numel)
      return tensor_error(path, t.name,
                          absl::StrCat("has ", t.data.size(), " values but shape ",
                                       shape_string(t.shape), " needs ", numel));
    const uint64_t bytes = uint64_t(numel) * 4;
    header[t.name] = {
        {"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    layout.push_back({t.name, DType::kF32, t.shape, offset, offset + bytes});
    crc = crc32c(t.data.data(), t.data.size_bytes(), crc);
    offset += bytes;
  }
  std::map<std::string, std::string> meta = metadata;
  meta[kChecksumKey] = absl::StrFormat("%08x", crc);
  meta[kLayoutChecksumKey] = absl::StrFormat("%08x", layout_crc(layout));
  header["__metadata__"] = meta;
  std::string text = header.empty() ? "{}" : header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the body 8-byte aligned for mmap users
  return write_file_atomic(path, [&](std::FILE* f) -> absl::Status {
    const uint64_t n = text.size();
    bool ok = std::fwrite(&n, 8, 1, f) == 1 && std::fwrite(text.data(), 1, n, f) == n;
    for (const NamedTensor& t : tensors)  // an empty tensor's data() may be null: no fwrite
      ok = ok &&
           (t.data.empty() || std::fwrite(t.data.data(), 4, t.data.size(), f) == t.data.size());
    return ok ? absl::OkStatus() : errno_error("write", path);
  });
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    close();
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    body_offset_ = o.body_offset_;
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
    size_ = o.size_;
    mtime_ns_ = o.mtime_ns_;
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { close(); }

void SafetensorsFile::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

uint64_t max_header_bytes(size_t tensors) { return (uint64_t(1) << 20) + uint64_t(tensors) * 1024; }

absl::StatusOr<SafetensorsFile> SafetensorsFile::open(const std::string& path,
                                                      size_t expected_tensors) {
  // O_NONBLOCK: opening a FIFO would otherwise wait forever for a writer (it is refused below,
  // as anything but a regular file is).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    return absl::NotFoundError(absl::StrCat("cannot open '", path, "': ", std::strerror(errno)));
  struct stat sb {};
  if (::fstat(fd, &sb) != 0) {
    const absl::Status st = errno_error("stat", path);
    ::close(fd);
    return st;
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is ", S_ISDIR(sb.st_mode) ? "a directory" : "not a regular file",
                     ", not a safetensors file: point at the .safetensors file itself"));
  }
  const uint64_t size = uint64_t(sb.st_size);
  if (size < 8) {
    ::close(fd);
    return header_error(path,
                        absl::StrCat("file is ", size,
                                     " bytes, too short for the 8-byte header length: truncated"));
  }
  SafetensorsFile f;
  f.path_ = path;
  f.fd_ = fd;  // closed with f
  f.size_ = int64_t(size);
  f.mtime_ns_ = nanoseconds(sb.st_mtim);
  uint64_t n = 0;
  CEMLM_RETURN_IF_ERROR(read_at(fd, path, 0, &n, 8));
  if (n > kMaxHeaderBytes && n <= size - 8)
    return header_error(path, absl::StrCat("header length ", n, " is over the format's limit of ",
                                           kMaxHeaderBytes, " bytes: not a safetensors file"));
  if (expected_tensors > 0 && n > max_header_bytes(expected_tensors) && n <= size - 8)
    return header_error(
        path, absl::StrCat("header length ", n, " is more than a file of ", expected_tensors,
                           " tensors needs (", max_header_bytes(expected_tensors),
                           " bytes at most, __metadata__ included): the file is damaged, or "
                           "holds other tensors than this config's"));
  if (n > size - 8)
    return header_error(path, absl::StrCat("header length ", n, " is beyond the end of the file (",
                                           size, " bytes): truncated or not a safetensors file"));
  std::string text(size_t(n), '\0');
  CEMLM_RETURN_IF_ERROR(read_at(fd, path, 8, text.data(), text.size()));
  // The format's header starts with its '{' (other readers refuse a byte-order mark or spaces
  // before it, which the JSON parser alone would skip).
  if (text.empty() || text[0] != '{')
    return header_error(path, "the header does not start with '{' (as the format requires)");
  // Strict: a tensor named twice would otherwise be silently the last one.
  absl::StatusOr<json> parsed = parse_json_strict(text);
  if (!parsed.ok()) return header_error(path, std::string(parsed.status().message()));
  const json& header = *parsed;
  if (!header.is_object()) return header_error(path, "not a valid JSON object");
  f.body_offset_ = 8 + n;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (auto st = parse_metadata(it.value(), &f.metadata_); !st.ok())
        return header_error(path, std::string(st.message()));
      continue;
    }
    TensorInfo t;
    t.name = it.key();
    if (auto st = parse_entry(it.value(), size - 8 - n, &t); !st.ok())
      return tensor_error(path, t.name, std::string(st.message()));
    f.tensors_.push_back(std::move(t));
  }
  std::sort(f.tensors_.begin(), f.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin < b.begin || (a.begin == b.begin && a.end < b.end);
  });
  // The body is the tensors' data back to back, as the format requires: a gap or trailing bytes
  // mean a header that does not describe this file (corrupt, or spliced from another).
  uint64_t covered = 0;
  for (size_t i = 0; i < f.tensors_.size(); ++i) {
    const TensorInfo& t = f.tensors_[i];
    if (t.begin < covered)
      return tensor_error(
          path, t.name,
          absl::StrCat("data overlaps tensor '", absl::CHexEscape(f.tensors_[i - 1].name), "'"));
    if (t.begin > covered)
      return tensor_error(path, t.name,
                          absl::StrCat("data starts at byte ", t.begin, " of the body, leaving bytes ",
                                       covered, "..", t.begin - 1, " that no tensor describes"));
    covered = t.end;
    f.index_[t.name] = i;
  }
  if (covered != size - 8 - n)
    return header_error(path, absl::StrCat("the tensors describe ", covered, " bytes of data but ",
                                           size - 8 - n,
                                           " follow the header: corrupt, or a header from "
                                           "another file"));
  CEMLM_RETURN_IF_ERROR(f.check_body());
  return f;
}

absl::Status SafetensorsFile::check_body() const {
  const auto it = metadata_.find(kChecksumKey);
  if (it == metadata_.end()) return absl::OkStatus();  // written by another program
  auto crc_of = [&](const char* key, uint32_t* value) -> absl::Status {
    const std::string& text = metadata_.at(key);
    // (SimpleHexAtoi alone takes a sign, "0x" and spaces: "+1234567" passed as 8 digits.)
    if (text.size() != 8 || !std::all_of(text.begin(), text.end(), absl::ascii_isxdigit) ||
        !absl::SimpleHexAtoi(text, value))
      return header_error(path_, absl::StrCat("__metadata__.", key, " \"", absl::CHexEscape(text),
                                              "\" is not 8 hex digits (a CRC-32C)"));
    return absl::OkStatus();
  };
  uint32_t want = 0;
  CEMLM_RETURN_IF_ERROR(crc_of(kChecksumKey, &want));
  // Another program that rewrote the file (reordered its tensors, converted them to BF16) and
  // kept its metadata left a checksum of other bytes: not damage, and nothing to check.
  if (metadata_.count(kLayoutChecksumKey)) {
    uint32_t layout = 0;
    CEMLM_RETURN_IF_ERROR(crc_of(kLayoutChecksumKey, &layout));
    if (layout != layout_crc(tensors_)) return absl::OkStatus();
  }
  const uint64_t end = tensors_.empty() ? body_offset_ : body_offset_ + tensors_.back().end;
  std::vector<char> chunk(size_t(1) << 20);
  uint32_t crc = 0;
  for (uint64_t at = body_offset_; at < end;) {
    const size_t n = size_t(std::min<uint64_t>(chunk.size(), end - at));
    CEMLM_RETURN_IF_ERROR(read_at(fd_, path_, at, chunk.data(), n));
    crc = crc32c(chunk.data(), n, crc);
    at += n;
  }
  if (crc != want)
    return absl::DataLossError(absl::StrCat(
        "'", path_, "' is damaged: its tensors' bytes do not match the CRC-32C written with them (",
        kChecksumKey, " ", it->second, ", the bytes give ", absl::StrFormat("%08x", crc),
        "); a disk or copy error changed them, or a program rewrote them in place and kept the "
        "metadata (then remove its '",
        kChecksumKey, "' entry). Use a good copy of the file"));
  return absl::OkStatus();
}

absl::Status SafetensorsFile::check_unchanged() const {
  struct stat sb {};
  if (::fstat(fd_, &sb) != 0) return errno_error("stat", path_);
  if (int64_t(sb.st_size) == size_ && nanoseconds(sb.st_mtim) == mtime_ns_) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "'", path_,
      "' was written to while it was read: it changed since it was opened (a copy over it?), so "
      "its tensors may mix old and new bytes; load it again once it is written whole"));
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

absl::Status SafetensorsFile::read_f32(const TensorInfo& t, std::span<float> out) const {
  if (int64_t(out.size()) != t.numel())
    return tensor_error(
        path_, t.name,
        absl::StrCat("caller's buffer holds ", out.size(), " floats, tensor has ", t.numel()));
  if (out.empty()) return absl::OkStatus();  // (an empty span's data() may be null)
  const uint64_t at = body_offset_ + t.begin;
  if (t.dtype == DType::kF32) {
    CEMLM_RETURN_IF_ERROR(read_at(fd_, path_, at, out.data(), out.size() * 4));
  } else {
    // Read in parts, converted as they come: no copy of the whole tensor's half-size values.
    constexpr size_t kPart = size_t(1) << 18;
    std::vector<uint16_t> half(std::min(kPart, out.size()));
    for (size_t i = 0; i < out.size(); i += half.size()) {
      const size_t count = std::min(half.size(), out.size() - i);
      CEMLM_RETURN_IF_ERROR(read_at(fd_, path_, at + 2 * i, half.data(), 2 * count));
      for (size_t j = 0; j < count; ++j)
        out[i + j] = t.dtype == DType::kBF16 ? bf16_to_f32(half[j]) : f16_to_f32(half[j]);
    }
  }
  CEMLM_RETURN_IF_ERROR(check_unchanged());
  for (size_t i = 0; i < out.size(); ++i)
    if (!std::isfinite(out[i]))
      return tensor_error(
          path_, t.name,
          absl::StrCat("element ", i, " is ", out[i], ": non-finite values are not allowed"));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> SafetensorsFile::read_f32(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t)
    return absl::NotFoundError(
        absl::StrCat(path_, ": no tensor named '", absl::CHexEscape(name), "'"));
  std::vector<float> v(size_t(t->numel()));
  CEMLM_RETURN_IF_ERROR(read_f32(*t, v));
  return v;
}

}  // namespace cemlm
