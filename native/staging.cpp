#include "staging.h"

#include <cstring>

#include "crc32.h"

namespace mlx_streaming {

Staging::Staging(std::shared_ptr<ExpertReader> reader, int capacity, int64_t stride)
    : reader_(std::move(reader)), stride_(stride), buffers_(capacity) {
  for (int i = 0; i < capacity; ++i) {
    buffers_[i].memory = std::make_unique<AlignedBuffer>(stride);
    free_.push_back(i);
  }
}

int Staging::stage(int layer, int file, const int64_t* experts, const int64_t* offsets, size_t n) {
  int issued = 0;
  for (size_t i = 0; i < n; ++i) {
    int b;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto key = std::make_pair(layer, experts[i]);
      if (entries_.count(key) || free_.empty()) {
        continue;
      }
      b = free_.back();
      free_.pop_back();
      buffers_[b].state = State::Queued;
      buffers_[b].owned = true;
      entries_[key] = b;
    }
    int64_t offset = offsets[i];
    uint8_t* memory = buffers_[b].memory->data;
    reader_->pool().submit(
        [self = shared_from_this(), file, offset, memory, b] {
          if (!self->start(b)) {
            return; // cancelled before it started
          }
          bool ok = true;
          try {
            self->reader_->read_record(file, offset, memory, self->stride_);
          } catch (const std::exception&) {
            ok = false; // take() reports a miss; the demand read raises
          }
          self->finish(b, ok);
        },
        /* urgent = */ false);
    ++issued;
  }
  return issued;
}

bool Staging::start(int b) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!buffers_[b].owned) {
    release(b);
    cancelled_ += 1;
    cv_.notify_all();
    return false;
  }
  buffers_[b].state = State::Reading;
  return true;
}

void Staging::finish(int b, bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  buffers_[b].state = ok ? State::Ready : State::Failed;
  if (!buffers_[b].owned) {
    release(b); // dropped while in flight
  }
  cv_.notify_all();
}

void Staging::release(int b) {
  buffers_[b].state = State::Free;
  buffers_[b].owned = false;
  free_.push_back(b);
}

std::optional<uint32_t> Staging::take(
    int layer,
    int64_t expert,
    const std::vector<Segment>& segments,
    const int64_t* dst_row,
    bool want_crc) {
  check_segments(segments, stride_);
  int b;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = entries_.find({layer, expert});
    if (it == entries_.end()) {
      return std::nullopt;
    }
    b = it->second;
    entries_.erase(it);
    if (buffers_[b].state == State::Queued) {
      buffers_[b].owned = false; // start() frees it
      return std::nullopt;
    }
    cv_.wait(lock, [&] { return buffers_[b].state != State::Reading; });
    if (buffers_[b].state == State::Failed) {
      release(b);
      return std::nullopt;
    }
  }
  // The buffer is ours until released: no lock needed for the copy.
  const uint8_t* src = buffers_[b].memory->data;
  uint32_t crc = 0;
  for (size_t j = 0; j < segments.size(); ++j) {
    auto* dst = reinterpret_cast<uint8_t*>(dst_row[j]);
    std::memcpy(dst, src + segments[j].offset, segments[j].nbytes);
    if (want_crc) {
      crc = crc32(crc, src + segments[j].offset, segments[j].nbytes);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  release(b);
  return crc;
}

int Staging::drop(int layer) {
  std::lock_guard<std::mutex> lock(mu_);
  int dropped = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (it->first.first != layer) {
      ++it;
      continue;
    }
    int b = it->second;
    if (buffers_[b].state == State::Queued || buffers_[b].state == State::Reading) {
      buffers_[b].owned = false; // start() or finish() frees it
    } else {
      release(b);
    }
    it = entries_.erase(it);
    ++dropped;
  }
  return dropped;
}

} // namespace mlx_streaming
