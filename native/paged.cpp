#include "paged.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace mlx_streaming {

namespace {

double now() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

} // namespace

PagedIndex::PagedIndex(
    std::shared_ptr<ExpertReader> reader,
    int file,
    int64_t stride,
    std::vector<Segment> segments,
    double decay,
    Verify verify)
    : reader_(std::move(reader)),
      file_(file),
      stride_(stride),
      segments_(std::move(segments)),
      decay_(decay),
      verify_(verify) {
  check_segments(segments_, stride_);
}

void PagedIndex::bind(const PagedArrays& arrays) {
  a_ = arrays;
  seen_.assign(static_cast<size_t>(a_.experts), 0);
  tick_ = 0;
}

int64_t PagedIndex::route(
    const uint32_t* ids, size_t n, double clock, std::vector<int64_t>& experts) {
  if (++tick_ == 0) { // wrapped: forget every stamp
    std::fill(seen_.begin(), seen_.end(), 0);
    tick_ = 1;
  }
  experts.clear();
  int64_t hits = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t e = ids[i];
    if (e >= a_.experts) {
      throw std::out_of_range(
          "router chose expert " + std::to_string(e) + " of " + std::to_string(a_.experts));
    }
    hits += a_.slot_of_expert[e] >= 0;
    if (seen_[e] != tick_) {
      seen_[e] = tick_;
      experts.push_back(e);
    }
  }
  std::sort(experts.begin(), experts.end());
  // The policy's observe(), in the reference's order of operations (a
  // multiply over every score, then the adds) so the doubles agree exactly.
  for (int64_t e : experts) {
    a_.last_use[e] = clock;
  }
  if (a_.score != nullptr) {
    for (int64_t j = 0; j <= a_.experts; ++j) {
      a_.score[j] *= decay_;
    }
    for (int64_t e : experts) {
      a_.score[e] += 1.0;
    }
  }
  return hits;
}

EnsureResult PagedIndex::ensure(const int64_t* experts, size_t n) {
  EnsureResult result;
  misses_.clear();
  key_.resize(a_.slots);
  const double* keep = a_.score != nullptr ? a_.score : a_.last_use;
  for (int64_t s = 0; s < a_.slots; ++s) {
    int64_t e = a_.expert_of_slot[s];
    key_[s] = e < 0 ? -std::numeric_limits<double>::infinity() : keep[e];
  }
  for (size_t i = 0; i < n; ++i) {
    int64_t e = experts[i];
    if (e < 0 || e >= a_.experts) {
      throw std::out_of_range("expert " + std::to_string(e) + " out of range");
    }
    int32_t s = a_.slot_of_expert[e];
    if (s >= 0) {
      key_[s] = std::numeric_limits<double>::infinity(); // protected
    } else {
      misses_.push_back(e);
    }
  }
  victims_.clear();
  if (misses_.empty()) {
    return result;
  }
  if (static_cast<int64_t>(n) > a_.slots) {
    throw std::invalid_argument("more distinct experts than slots");
  }
  double start = now();
  // Stable order by key: ties go to the lowest slot (the reference sorts
  // with numpy's stable argsort).
  order_.resize(a_.slots);
  std::iota(order_.begin(), order_.end(), 0);
  std::stable_sort(order_.begin(), order_.end(),
                   [&](int64_t x, int64_t y) { return key_[x] < key_[y]; });
  victims_.assign(order_.begin(), order_.begin() + misses_.size());
  // Until the bytes are in and checked the slots hold nothing valid.
  for (int64_t s : victims_) {
    int64_t old = a_.expert_of_slot[s];
    if (old >= 0) {
      a_.slot_of_expert[old] = -1;
    }
    a_.expert_of_slot[s] = -1;
  }
  size_t m = misses_.size(), segs = segments_.size();
  offsets_.resize(m);
  dst_.resize(m * segs);
  if (want_capacity_ < m) {
    want_ = std::make_unique<bool[]>(m);
    want_capacity_ = m;
  }
  bool any_crc = false;
  for (size_t i = 0; i < m; ++i) {
    offsets_[i] = misses_[i] * stride_;
    std::copy_n(a_.addresses + victims_[i] * segs, segs, dst_.begin() + i * segs);
    want_[i] = verify_ == Verify::Always || (verify_ == Verify::FirstRead && a_.unverified[misses_[i]]);
    any_crc = any_crc || want_[i];
  }
  double read_start = now();
  std::vector<uint32_t> crcs = reader_->read(
      file_, offsets_.data(), m, segments_, dst_.data(),
      want_.get(), stride_);
  result.read_s = now() - read_start;
  result.read = static_cast<int64_t>(m);
  if (any_crc) {
    for (size_t i = 0; i < m; ++i) {
      if (want_[i] && crcs[i] != a_.checksums[misses_[i]]) {
        result.bad = misses_[i];
        result.load_s = now() - start;
        return result;
      }
    }
    for (int64_t e : misses_) {
      a_.unverified[e] = false;
    }
  }
  for (size_t i = 0; i < m; ++i) {
    a_.expert_of_slot[victims_[i]] = misses_[i];
    a_.slot_of_expert[misses_[i]] = static_cast<int32_t>(victims_[i]);
  }
  result.load_s = now() - start;
  return result;
}

} // namespace mlx_streaming
