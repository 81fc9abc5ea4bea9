// Prefetched expert records, keyed by (layer, expert), read in the
// background into aligned buffers. A staged record is copied into its slot
// only when the layer really routes to it, so a wrong prediction costs a
// read but never evicts a resident expert.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "reader.h"

namespace mlx_streaming {

class Staging : public std::enable_shared_from_this<Staging> {
 public:
  Staging(std::shared_ptr<ExpertReader> reader, int capacity, int64_t stride);

  // Starts background reads of the records of `experts` (at `offsets` of
  // `file`) that are not staged yet, while buffers are free. Returns the
  // number of reads issued.
  int stage(int layer, int file, const int64_t* experts, const int64_t* offsets, size_t n);

  // Copies a staged record's segments to `dst_row`, waiting if its read is
  // in flight. Returns its CRC-32 (0 if not asked), or nothing when the
  // expert is not staged, its read failed, or its read has not started yet
  // (it is cancelled: the caller's demand read goes first in the queue).
  std::optional<uint32_t> take(
      int layer,
      int64_t expert,
      const std::vector<Segment>& segments,
      const int64_t* dst_row,
      bool want_crc);

  // Forgets the records staged for `layer` (reads not started yet are
  // cancelled); returns how many there were.
  int drop(int layer);

  // Staged reads cancelled before they started (never read), in total.
  int64_t cancelled() const {
    return cancelled_.load();
  }

  int64_t stride() const {
    return stride_;
  }

 private:
  enum class State { Free, Queued, Reading, Ready, Failed };
  struct Buffer {
    std::unique_ptr<AlignedBuffer> memory;
    State state = State::Free;
    bool owned = false; // still reachable through entries_
  };

  bool start(int buffer);
  void finish(int buffer, bool ok);
  void release(int buffer);

  std::shared_ptr<ExpertReader> reader_;
  int64_t stride_;
  std::vector<Buffer> buffers_;
  std::vector<int> free_;
  std::map<std::pair<int, int64_t>, int> entries_;
  std::atomic<int64_t> cancelled_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

} // namespace mlx_streaming
