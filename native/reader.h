// Batched, parallel reads of expert records from blob files straight into
// slot memory, on a persistent thread pool.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
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

// A disk of `bytes_per_s` emulated on a faster one, for benchmarks: each
// read ends no earlier than a device serving one stream of bytes at that
// rate would end it. Idle time earns no credit. (A cgroup blkio throttle
// banks its idle time and lets the next reads through in a burst, which
// hands the disk's idle time to demand reads for free, the time that
// prefetch exists to use.)
class ReadPace {
 public:
  using Clock = std::chrono::steady_clock;
  explicit ReadPace(double bytes_per_s);
  // Books `nbytes` on the device; the read may end at the time returned.
  Clock::time_point book(int64_t nbytes);

 private:
  std::mutex mu_;
  double seconds_per_byte_;
  Clock::time_point free_;
};

// What the disk did: bytes read and the seconds in which at least one read
// was in flight (reads that overlap count once). Their ratio is the rate the
// disk gave the reads as they were issued, whoever issued them: prefetch's
// budget measures it so, since a demand read's wait alone also holds the
// reads ahead it queued behind, and overstates the disk's time.
class BusyMeter {
 public:
  using Clock = std::chrono::steady_clock;
  void begin();
  void end(int64_t nbytes);
  // (bytes, busy seconds) since the reader was made.
  std::pair<int64_t, double> totals();

 private:
  std::mutex mu_;
  int active_ = 0;
  Clock::time_point since_;
  Clock::duration busy_{0};
  int64_t bytes_ = 0;
};

class ExpertReader {
 public:
  // `pace_bytes_per_s` > 0: every read is paced by a ReadPace of that rate.
  ExpertReader(int threads, bool direct, double pace_bytes_per_s = 0);
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
  BusyMeter& meter() {
    return meter_;
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
  // pread_full, paced when the reader is, and metered.
  void pread_paced(const File& f, uint8_t* buf, int64_t n, int64_t offset);

  bool direct_;
  std::unique_ptr<ReadPace> pace_;
  BusyMeter meter_;
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
