#include "paged.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

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
    double shadow_decay,
    double lru_margin,
    Checksums checksums,
    std::string blob)
    : reader_(std::move(reader)),
      file_(file),
      blob_(checksums == Checksums::FirstRead ? std::move(blob) : std::string()),
      stride_(stride),
      segments_(std::move(segments)),
      decay_(decay),
      shadow_decay_(shadow_decay),
      lru_margin_(lru_margin),
      checksums_(checksums) {
  check_segments(segments_, stride_);
  blob_changed(); // the reference stamp
}

bool PagedIndex::blob_changed() {
  if (blob_.empty()) {
    return false;
  }
  Stamp now;
  struct stat st;
  if (::stat(blob_.c_str(), &st) == 0) {
#ifdef __APPLE__
    int64_t mtime = int64_t(st.st_mtimespec.tv_sec) * 1000000000 + st.st_mtimespec.tv_nsec;
    int64_t ctime = int64_t(st.st_ctimespec.tv_sec) * 1000000000 + st.st_ctimespec.tv_nsec;
#else
    int64_t mtime = int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    int64_t ctime = int64_t(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
#endif
    // ctime too: a file rewritten with its mtime put back still changes it.
    now = {uint64_t(st.st_ino), uint64_t(st.st_size), mtime, ctime, true};
  }
  if (now == stamp_) {
    return false;
  }
  stamp_ = now;
  return true;
}

void PagedIndex::unbind() {
  std::lock_guard<std::mutex> lock(mutex_);
  a_ = PagedArrays{};
}

void PagedIndex::bind(const PagedArrays& arrays) {
  std::lock_guard<std::mutex> lock(mutex_);
  a_ = arrays;
  seen_.assign(static_cast<size_t>(a_.experts), 0);
  tick_ = 0;
}

void PagedIndex::check_bound() const {
  if (a_.slot_of_expert == nullptr) {
    throw ReadError("this model was closed; load it again to use it");
  }
}

int64_t PagedIndex::route(const uint32_t* ids, size_t n, std::vector<int64_t>& experts) {
  check_bound();
  double clock = clock_ + 1; // advanced once the ids are known to be valid
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
  clock_ = clock;
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
  if (a_.shadow != nullptr) {
    observe_shadows(experts);
  }
  return hits;
}

void PagedIndex::observe_shadows(const std::vector<int64_t>& experts) {
  const double* keys[2] = {a_.last_use, a_.score};
  const int64_t width = a_.experts + 1;
  for (int arm = 0; arm < 2; ++arm) {
    bool* member = a_.shadow + arm * width;
    int64_t missed = 0;
    for (int64_t e : experts) {
      missed += !member[e];
      member[e] = true;
    }
    int64_t over = std::count(member, member + width, true) - a_.slots;
    if (over > 0) {
      // The shadow's lowest keys go, never the call's experts; ties to the
      // lowest expert id (the reference's stable argsort).
      for (int64_t e : experts) {
        member[e] = false;
      }
      held_.clear();
      for (int64_t j = 0; j < width; ++j) {
        if (member[j]) {
          held_.push_back(j);
        }
      }
      const double* key = keys[arm];
      std::stable_sort(held_.begin(), held_.end(),
                       [&](int64_t x, int64_t y) { return key[x] < key[y]; });
      for (int64_t i = 0; i < std::min<int64_t>(over, held_.size()); ++i) {
        member[held_[i]] = false;
      }
      for (int64_t e : experts) {
        member[e] = true;
      }
    }
    a_.misses[arm] = a_.misses[arm] * shadow_decay_ + static_cast<double>(missed);
  }
}

const double* PagedIndex::keep_score() const {
  if (a_.shadow != nullptr && a_.misses[0] < lru_margin_ * a_.misses[1]) {
    return a_.last_use; // the adaptive policy follows LRU
  }
  return a_.score != nullptr ? a_.score : a_.last_use;
}

EnsureResult PagedIndex::ensure(const int64_t* experts, size_t n) {
  check_bound();
  EnsureResult result;
  misses_.clear();
  key_.resize(a_.slots);
  const double* keep = keep_score();
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
    want_[i] = checksums_ == Checksums::Always || (checksums_ == Checksums::FirstRead && a_.unchecked[misses_[i]]);
    any_crc = any_crc || want_[i];
  }
  double read_start = now();
  std::vector<uint32_t> crcs = reader_->read(
      file_, offsets_.data(), m, segments_, dst_.data(),
      want_.get(), stride_);
  result.read = static_cast<int64_t>(m);
  if (blob_changed()) {
    // These bytes may come from the new file: read them again, checked,
    // and check every later first read from it (ExpertStore.load's rule).
    std::fill(a_.unchecked, a_.unchecked + a_.experts, true);
    std::fill(want_.get(), want_.get() + m, true);
    any_crc = true;
    crcs = reader_->read(file_, offsets_.data(), m, segments_, dst_.data(), want_.get(), stride_);
    result.read += static_cast<int64_t>(m);
  }
  result.read_s = now() - read_start;
  if (any_crc) {
    for (size_t i = 0; i < m; ++i) {
      if (want_[i] && crcs[i] != a_.checksums[misses_[i]]) {
        result.bad = misses_[i];
        result.load_s = now() - start;
        return result;
      }
    }
    for (int64_t e : misses_) {
      a_.unchecked[e] = false;
    }
  }
  for (size_t i = 0; i < m; ++i) {
    a_.expert_of_slot[victims_[i]] = misses_[i];
    a_.slot_of_expert[misses_[i]] = static_cast<int32_t>(victims_[i]);
  }
  result.load_s = now() - start;
  return result;
}

void PagedIndex::remap(const uint32_t* ids, size_t n, size_t k, int32_t* slots) {
  std::fill(slots, slots + n, 0); // in range whatever happens below
  std::lock_guard<std::mutex> lock(mutex_);
  if (a_.slot_of_expert == nullptr) {
    if (error_.kind == Failure::None) {
      error_ = {Failure::Read, -1, "this model was closed; load it again to use it"};
    }
    return;
  }
  try {
    int64_t hits = route(ids, n, experts_);
    EnsureResult r = ensure(experts_.data(), experts_.size());
    counters_.calls += 1;
    counters_.tokens += static_cast<int64_t>(k ? n / k : 0);
    counters_.hits += hits;
    counters_.misses += static_cast<int64_t>(n) - hits;
    counters_.distinct += static_cast<int64_t>(experts_.size());
    counters_.records += r.read;
    counters_.read_s += r.read_s;
    if (r.bad < 0) {
      counters_.stall_s += r.load_s;
    } else if (error_.kind == Failure::None) {
      error_ = {Failure::Checksum, r.bad, "checksum mismatch"};
    }
  } catch (const ReadError& e) {
    if (error_.kind == Failure::None) {
      error_ = {Failure::Read, -1, e.what()};
    }
  } catch (const std::exception& e) {
    if (error_.kind == Failure::None) {
      error_ = {Failure::Other, -1, e.what()};
    }
  } catch (...) {
    if (error_.kind == Failure::None) {
      error_ = {Failure::Other, -1, "unknown failure"};
    }
  }
  // An expert not resident after a failure computes with slot 0: the
  // output is wrong, and Python raises the error before returning it.
  for (size_t i = 0; i < n; ++i) {
    uint32_t e = ids[i];
    int32_t s = e < static_cast<uint32_t>(a_.experts) ? a_.slot_of_expert[e] : -1;
    slots[i] = s < 0 ? 0 : s;
  }
}

PagedCounters PagedIndex::take_counters() {
  std::lock_guard<std::mutex> lock(mutex_);
  PagedCounters out = counters_;
  counters_ = PagedCounters();
  return out;
}

PagedError PagedIndex::take_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  PagedError out = error_;
  error_ = PagedError();
  return out;
}

mx::array paged_remap(
    const mx::array& ids, const mx::array& table, std::shared_ptr<PagedIndex> index,
    mx::StreamOrDevice s) {
  if ((ids.dtype() != mx::int32 && ids.dtype() != mx::uint32) || table.dtype() != mx::int32 ||
      table.ndim() != 1) {
    throw std::invalid_argument("paged_remap takes int32 or uint32 ids and a 1-D int32 table");
  }
  if (index->slots() > 0 && static_cast<int64_t>(ids.size()) > index->slots()) {
    // (0 slots: unbound, the model closed; remap records that error)
    throw std::invalid_argument("paged_remap: more ids than slots; use the host-synced call");
  }
  auto stream = mx::to_stream(s);
  auto flat = mx::contiguous(ids, false, stream);
  return mx::array(
      ids.shape(), mx::int32, std::make_shared<PagedRemap>(stream, std::move(index)),
      {flat, table});
}

void PagedRemap::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  // Runs on the stream's thread after everything queued before it, so no
  // computation that reads this layer's pool is still running when it
  // writes slots; everything that reads them is queued after it.
  encoder.dispatch([ids = inputs[0], out, index = index_]() mutable {
    size_t k = ids.ndim() ? ids.shape(-1) : 1;
    index->remap(reinterpret_cast<const uint32_t*>(ids.data<int32_t>()), ids.size(), k,
                 out.data<int32_t>());
  });
}

void PagedRemap::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  // A GPU would need the host to fill slots between two kernels; there the
  // paged call syncs instead (block.NativePaged chooses at load).
  throw std::runtime_error("paged_remap runs on the CPU backend only");
}

} // namespace mlx_streaming
