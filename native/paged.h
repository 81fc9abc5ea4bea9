// The host bookkeeping of one paged MoE call, in one native step: the
// distinct experts of the router's ids, hit counting, the eviction policy's
// update (LRU or decayed LFU), victim choice, reads of the misses and the
// id-to-slot table update. mlx_streaming/store.py's ExpertStore and
// policy.py's LRU / DecayedLFU are the reference this must agree with,
// state for state (tests/test_native_paging.py).
//
// Every array is borrowed from Python (the pool's tables, the policy's
// scores, the store's checksums): Python owns them and rebinds after a pool
// resize, so both paths always see one state.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "reader.h"

namespace mlx_streaming {

enum class Verify { Off = 0, FirstRead = 1, Always = 2 };

struct PagedArrays {
  int32_t* slot_of_expert; // [experts], -1: not resident (the device table)
  int64_t* expert_of_slot; // [slots], -1: empty
  const int64_t* addresses; // [slots, segments] destination of each segment
  double* last_use; // [experts + 1], the policy's
  double* score; // [experts + 1], decayed LFU's; null for LRU
  const uint32_t* checksums; // [experts]
  bool* unverified; // [experts]
  int64_t experts;
  int64_t slots;
};

struct EnsureResult {
  int64_t read = 0; // records read
  int64_t bad = -1; // an expert whose checksum failed (its slot left empty)
  double read_s = 0; // in the reader
  double load_s = 0; // evict, read, check and map (the stall)
};

class PagedIndex {
 public:
  PagedIndex(
      std::shared_ptr<ExpertReader> reader,
      int file,
      int64_t stride,
      std::vector<Segment> segments,
      double decay,
      Verify verify);

  void bind(const PagedArrays& arrays);

  // The distinct experts of `ids` (sorted, into `experts`) and how many of
  // the n ids hit; the policy observes the call at `clock`.
  int64_t route(const uint32_t* ids, size_t n, double clock, std::vector<int64_t>& experts);

  // Makes the distinct `experts` resident: misses take the slots of lowest
  // keep-score (empty first, ties to the lowest slot, never a hit's slot).
  EnsureResult ensure(const int64_t* experts, size_t n);

  // The misses and their slots of the last ensure (for a re-read).
  const std::vector<int64_t>& misses() const {
    return misses_;
  }
  const std::vector<int64_t>& victims() const {
    return victims_;
  }

 private:
  std::shared_ptr<ExpertReader> reader_;
  int file_;
  int64_t stride_;
  std::vector<Segment> segments_;
  double decay_;
  Verify verify_;
  PagedArrays a_{};
  std::vector<uint32_t> seen_; // per expert: the route() call that saw it last
  uint32_t tick_ = 0;
  std::vector<int64_t> misses_, victims_, offsets_, dst_, order_;
  std::vector<double> key_;
  std::unique_ptr<bool[]> want_;
  size_t want_capacity_ = 0;
};

} // namespace mlx_streaming
