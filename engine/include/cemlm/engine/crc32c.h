// CRC-32C (Castagnoli, the iSCSI / ext4 / gRPC checksum): what cemlm's safetensors writer puts in
// a file's metadata so that its reader can tell a damaged body (a flipped exponent bit turns a
// weight of 1e-3 into 1e35) from a sound one.
#pragma once
#include <cstddef>
#include <cstdint>

namespace cemlm {

// The CRC-32C of `bytes` following `crc` (0 to start; the result of the previous part to go on,
// so that a file read in parts gives the CRC of the whole). crc32c("123456789") = 0xE3069283.
uint32_t crc32c(const void* bytes, size_t n, uint32_t crc = 0);
// The same by a byte table: what crc32c() runs on a CPU without SSE4.2 (and tests compare).
uint32_t crc32c_portable(const void* bytes, size_t n, uint32_t crc = 0);

}  // namespace cemlm
