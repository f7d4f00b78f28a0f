// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of every
// checkpoint file and of every block of NVMe-resident swap state. Chosen because x86-64 (SSE4.2 `crc32`) and ARMv8 (`crc32c*`)
// compute it in hardware at several GB/s per core, faster than the disks a
// checkpoint streams from, so checksumming never becomes the bottleneck.
//
// Values are the standard finalized CRC (the one iSCSI, ext4 and LevelDB
// print): crc32c("123456789") == 0xE3069283, crc32c("") == 0.
// crc32c_extend continues a finalized CRC over more bytes, so a stream is
// checksummed chunk by chunk:
//   uint32_t c = 0;
//   for (chunk : chunks) c = crc32c_extend(c, chunk.data(), chunk.size());
//   // c == crc32c(all bytes)
//
// All functions are pure and thread-safe. The hardware path is chosen once
// (CPUID / HWCAP at first use); the portable path is always compiled in and the
// tests check that both agree.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// Best available implementation.
uint32_t crc32c_extend(uint32_t crc, const void* data, std::size_t n);
inline uint32_t crc32c(const void* data, std::size_t n) {
  return crc32c_extend(0, data, n);
}

// The CRC of each `block`-byte piece of data[0, n) (the last one may be
// shorter) into out[0 .. ceil(n / block)). Swap-file checksums use it: with
// hardware CRC it runs three blocks at once, about 3x crc32c's speed.
// block == 0 means one block of n bytes.
void crc32c_blocks(const void* data, std::size_t n, std::size_t block, uint32_t* out);

// The CRC of A followed by B from crc32c(A), crc32c(B) and B's length
// (zlib's crc32_combine for this polynomial). O(log len2).
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);

// Slice-by-8 tables; any CPU.
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, std::size_t n);

// True when this CPU has CRC32C instructions (x86 SSE4.2, ARMv8 CRC).
bool crc32c_hw_available();
// The hardware path; falls back to the portable one when
// crc32c_hw_available() is false, so it is always safe to call.
uint32_t crc32c_extend_hw(uint32_t crc, const void* data, std::size_t n);

// "hw-sse4.2", "hw-armv8" or "portable": what crc32c_extend uses.
const char* crc32c_impl_name();

}  // namespace strata
