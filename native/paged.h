// The host bookkeeping of one paged MoE call, in one native step: the
// distinct experts of the router's ids, hit counting, the eviction policy's
// update (LRU, decayed LFU or adaptive), victim choice, reads of the misses and the
// id-to-slot table update. mlx_streaming/runtime/store.py's ExpertStore and
// policy.py's LRU / DecayedLFU / Adaptive are the reference this must agree with,
// state for state (tests/runtime/test_native_paging.py).
//
// Every array is borrowed from Python (the pool's tables, the policy's
// scores, the store's checksums): Python owns them and rebinds after a pool
// resize, so both paths always see one state.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "reader.h"

namespace mlx_streaming {

enum class Checksums { Off = 0, FirstRead = 1, Always = 2 };

struct PagedArrays {
  int32_t* slot_of_expert; // [experts], -1: not resident (the device table)
  int64_t* expert_of_slot; // [slots], -1: empty
  const int64_t* addresses; // [slots, segments] destination of each segment
  double* last_use; // [experts + 1], the policy's
  double* score; // [experts + 1], decayed LFU's; null for LRU
  bool* shadow; // [2, experts + 1], the adaptive policy's LRU and LFU shadow pools; or null
  double* misses; // [2], each shadow's decayed misses; null with shadow
  const uint32_t* checksums; // [experts]
  bool* unchecked; // [experts]
  int64_t experts;
  int64_t slots;
};

// What the calls made inside the graph (paged_remap) did, per layer, until
// Python takes them (one event per forward pass instead of one per call).
struct PagedCounters {
  int64_t calls = 0;
  int64_t tokens = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t distinct = 0;
  int64_t records = 0;
  double read_s = 0;
  double stall_s = 0;
};

// What failed inside the graph (bound as _ext.Failure).
enum class Failure { None = 0, Read = 1, Checksum = 2, Other = 3 };

// A failure inside the graph, raised by Python after the forward pass.
struct PagedError {
  Failure kind = Failure::None;
  int64_t expert = -1;
  std::string message;
};

struct EnsureResult {
  int64_t read = 0; // records read
  int64_t bad = -1; // an expert whose checksum failed (its slot left empty)
  double read_s = 0; // in the reader
  double load_s = 0; // evict, read, check and map (the stall)
};

class PagedIndex : public std::enable_shared_from_this<PagedIndex> {
 public:
  // `blob`: the file's path, stat-ed after reads when checksums is first-read
  // (a blob rewritten or replaced on disk is re-checked); empty: never.
  PagedIndex(
      std::shared_ptr<ExpertReader> reader,
      int file,
      int64_t stride,
      std::vector<Segment> segments,
      double decay,
      double shadow_decay,
      double lru_margin,
      Checksums checksums,
      std::string blob);

  void bind(const PagedArrays& arrays);
  // Forget the borrowed arrays (the model is closing): a remap left in a
  // lazy graph then records an error and maps every id to slot 0.
  void unbind();

  // The distinct experts of `ids` (sorted, into `experts`) and how many of
  // the n ids hit; the policy observes the call (its clock advances).
  int64_t route(const uint32_t* ids, size_t n, std::vector<int64_t>& experts);

  // Makes the distinct `experts` resident: misses take the slots of lowest
  // keep-score (empty first, ties to the lowest slot, never a hit's slot).
  EnsureResult ensure(const int64_t* experts, size_t n);

  // A whole call inside the graph (n ids, k per token): route, ensure, and each id's slot into
  // `slots`; failures are recorded (error()), never thrown, and leave every
  // slot id in range.
  void remap(const uint32_t* ids, size_t n, size_t k, int32_t* slots);

  double clock() const {
    return clock_;
  }
  void set_clock(double clock) {
    clock_ = clock;
  }
  int64_t slots() const {
    return a_.slots;
  }
  size_t segments() const {
    return segments_.size();
  }
  PagedCounters take_counters();
  PagedError take_error();

 private:
  bool blob_changed();
  void observe_shadows(const std::vector<int64_t>& experts); // Adaptive.observe's
  const double* keep_score() const;
  void check_bound() const; // throws ReadError once unbound (closed)

  std::shared_ptr<ExpertReader> reader_;
  int file_;
  std::string blob_;
  struct Stamp {
    uint64_t ino = 0, size = 0;
    int64_t mtime_ns = 0, ctime_ns = 0;
    bool exists = false;
    bool operator==(const Stamp&) const = default;
  } stamp_;
  double clock_ = 0;
  PagedCounters counters_;
  PagedError error_;
  std::vector<int64_t> experts_;
  std::mutex mutex_; // remap (stream thread) against take_* (host)
  int64_t stride_;
  std::vector<Segment> segments_;
  double decay_;
  double shadow_decay_;
  double lru_margin_;
  Checksums checksums_;
  PagedArrays a_{};
  std::vector<uint32_t> seen_; // per expert: the route() call that saw it last
  uint32_t tick_ = 0;
  std::vector<int64_t> misses_, victims_, offsets_, dst_, order_, held_;
  std::vector<double> key_;
  std::unique_ptr<bool[]> want_;
  size_t want_capacity_ = 0;
};

namespace mx = mlx::core;

// The slot of each of `ids` (int32 or uint32, any shape) in `table`'s layer,
// once `index` has made them resident: an MLX primitive, so the call's
// bookkeeping and reads run on the stream's thread when the router's ids are
// computed, with no host sync. CPU backend only (eval_gpu throws); at most
// `index.slots()` ids per call.
mx::array paged_remap(
    const mx::array& ids, const mx::array& table, std::shared_ptr<PagedIndex> index,
    mx::StreamOrDevice s = {});

class PagedRemap : public mx::UnaryPrimitive {
 public:
  PagedRemap(mx::Stream stream, std::shared_ptr<PagedIndex> index)
      : mx::UnaryPrimitive(stream), index_(std::move(index)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "PagedRemap";
  }

 private:
  std::shared_ptr<PagedIndex> index_;
};

} // namespace mlx_streaming
