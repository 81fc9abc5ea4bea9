// CRC-32 with zlib's polynomial, so records checked here and in Python's
// zlib.crc32 agree.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlx_streaming {

// Continue a CRC-32 over `n` bytes at `data` (start with crc = 0).
uint32_t crc32(uint32_t crc, const uint8_t* data, size_t n);

} // namespace mlx_streaming
