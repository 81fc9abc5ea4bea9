// Batched, parallel reads of expert records from blob files straight into
// slot memory, on a persistent thread pool.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "thread_pool.h"

namespace mlx_streaming {

// Direct (uncached) reads need this alignment of buffer, offset and size.
constexpr int64_t kDirectAlignment = 4096;
// Records are split into pieces of at most this size, so one large expert
// is read by several threads at once.
constexpr int64_t kChunkBytes = 1 << 20;
// Jobs smaller than this run on the calling thread: a hand-off to the pool
// costs more than the copy out of the page cache.
constexpr int64_t kInlineBytes = 512 << 10;

// A failed or short read; the message names the file and offset.
class ReadError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Segment {
  int64_t offset; // in the record
  int64_t nbytes;
};

struct File {
  int fd;
  std::string path;
};

class ExpertReader {
 public:
  ExpertReader(int threads, bool direct);
  ~ExpertReader();

  // Opens a blob; returns its handle for read() and stage().
  int open(const std::string& path);
  void close();

  // Reads records at `offsets` of `file` into `dst` (n x segments.size()
  // destination addresses). Returns the CRC-32 of each record whose
  // `checksum` flag is set (0 for the others). Blocks until done.
  std::vector<uint32_t> read(
      int file,
      const int64_t* offsets,
      size_t n,
      const std::vector<Segment>& segments,
      const int64_t* dst,
      const bool* checksum,
      int64_t stride);

  // Reads one whole record into an aligned buffer (prefetch staging).
  void read_record(int file, int64_t offset, uint8_t* buffer, int64_t stride);

  ThreadPool& pool() {
    return *pool_;
  }
  bool direct() const {
    return direct_;
  }
  int threads() const {
    return pool_->size();
  }

 private:
  void read_piece(
      const File& f,
      int64_t record,
      int64_t begin,
      int64_t end,
      const std::vector<Segment>& segments,
      const int64_t* dst_row);
  const File& file(int handle) const;

  bool direct_;
  std::deque<File> files_; // deque: references stay valid as files open
  std::unique_ptr<ThreadPool> pool_;
};

// Throws ReadError unless every segment lies inside a record of `stride`
// bytes: a damaged manifest must never make a copy run off a buffer.
void check_segments(const std::vector<Segment>& segments, int64_t stride);

// Reads exactly `n` bytes at `offset`, retrying partial reads.
void pread_full(const File& f, uint8_t* buf, int64_t n, int64_t offset);

// An aligned buffer for direct reads.
struct AlignedBuffer {
  explicit AlignedBuffer(int64_t n);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  uint8_t* data;
};

} // namespace mlx_streaming
