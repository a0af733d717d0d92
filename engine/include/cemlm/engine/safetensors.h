// safetensors files: a reader (F32, BF16, F16 in the file; F32 out; read with pread, not mapped)
// and an F32 writer that replaces its target atomically. Format: 8-byte little-endian header
// length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str:
// str}}, the body. Every malformed input is refused with a message naming the tensor (or "header").
#pragma once
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace cemlm {

enum class DType { kF32, kF16, kBF16 };

// One tensor to write: a view of numel(shape) floats owned by the caller.
struct NamedTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::span<const float> data;
};

// Creates `path` atomically: `fill` writes the content into a temporary sibling, which is synced
// and renamed over `path` only when `fill` succeeds; on failure the temporary is removed and any
// old `path` is left untouched. For small side files (JSON state) as well as tensors. A symbolic
// link at `path` is written through; anything else there but a regular file is refused.
absl::Status write_file_atomic(const std::string& path,
                               const std::function<absl::Status(std::FILE*)>& fill);

// The __metadata__ keys of the CRC-32C of a file's body and of its tensor entries (8 lowercase
// hex digits each), which write_safetensors adds. SafetensorsFile::open checks the body against
// the first when the file has it, unless the second shows that another program rewrote the file
// (reordered or converted its tensors) and kept the metadata.
inline constexpr char kChecksumKey[] = "crc32c";
inline constexpr char kLayoutChecksumKey[] = "crc32c_layout";

// Writes `tensors` as F32 in the given order, with `metadata` and the body's kChecksumKey. The file
// appears at `path` only once complete (written to a temporary sibling, synced, then renamed), so
// readers never see half a file.
absl::Status write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                               const std::map<std::string, std::string>& metadata = {});

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the body
  int64_t numel() const;
};

// An open, validated file. Opening checks the whole header against the file size, and the body
// against its kChecksumKey when the file has one (a read of the whole file); values are converted
// (and checked finite) only when a tensor is read.
// The longest header a file of `tensors` tensors has: a KiB for each tensor's entry (its name,
// dtype, shape and offsets take ~100 bytes) and a MiB for __metadata__.
uint64_t max_header_bytes(size_t tensors);

class SafetensorsFile {
 public:
  // expected_tensors > 0 (those a reader will look up): a header longer than such a file's
  // needs (max_header_bytes) is refused before it is parsed, which takes ~20× its bytes; else the
  // format's 100 MB limit.
  static absl::StatusOr<SafetensorsFile> open(const std::string& path, size_t expected_tensors = 0);
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // In body order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Converts one tensor to F32 into `out` (exactly numel floats); refuses non-finite values, and
  // a file written to since it was opened (what open checked is then not what was read).
  absl::Status read_f32(const TensorInfo& t, std::span<float> out) const;
  absl::StatusOr<std::vector<float>> read_f32(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  void close();
  absl::Status check_body() const;  // DataLossError when the body's CRC-32C is not the header's
  // DataLossError when the file is no longer as it was opened (its size, or the modification
  // time each write sets): bytes written over it in place since would load unchecked by the CRC.
  // (Not the change time: that moves when the file is only unlinked, as a checkpoint's save
  // does to the old one, whose bytes stay as they were.)
  absl::Status check_unchanged() const;

  std::string path_;
  int fd_ = -1;  // open for the reads of read_f32
  // The file as opened: its size and modification time.
  int64_t size_ = 0;
  int64_t mtime_ns_ = 0;
  uint64_t body_offset_ = 0;  // where the tensors' data starts in the file
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;  // name → position in tensors_
  std::map<std::string, std::string> metadata_;
};

const char* dtype_name(DType d);
std::string shape_string(const std::vector<int64_t>& shape);  // "[2, 3]"

}  // namespace cemlm
