#include "reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "crc32.h"

namespace mlx_streaming {

AlignedBuffer::AlignedBuffer(int64_t n) : data(nullptr) {
  void* p = nullptr;
  if (posix_memalign(&p, kDirectAlignment, static_cast<size_t>(n)) != 0) {
    throw std::bad_alloc();
  }
  data = static_cast<uint8_t*>(p);
}

AlignedBuffer::~AlignedBuffer() {
  free(data);
}

void pread_full(const File& f, uint8_t* buf, int64_t n, int64_t offset) {
  int64_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(f.fd, buf + done, n - done, offset + done);
    if (got < 0) {
      if (errno == EINTR) {
        continue;
      }
      throw ReadError(
          "read of " + f.path + " at offset " + std::to_string(offset + done) +
          " failed: " + std::strerror(errno));
    }
    if (got == 0) {
      throw ReadError(
          "short read of " + f.path + " at offset " + std::to_string(offset) +
          ": " + std::to_string(done) + " of " + std::to_string(n) +
          " bytes; the blob is truncated, re-convert the model");
    }
    done += got;
  }
}

void check_segments(const std::vector<Segment>& segments, int64_t stride) {
  if (stride <= 0) {
    throw ReadError("record stride must be positive, got " + std::to_string(stride));
  }
  for (const auto& s : segments) {
    if (s.offset < 0 || s.nbytes < 0 || s.offset > stride || s.nbytes > stride - s.offset) {
      throw ReadError(
          "segment at offset " + std::to_string(s.offset) + " of " + std::to_string(s.nbytes) +
          " bytes lies outside the " + std::to_string(stride) + "-byte record");
    }
  }
}

ReadPace::ReadPace(double bytes_per_s)
    : seconds_per_byte_(1.0 / bytes_per_s), free_(Clock::now()) {}

ReadPace::Clock::time_point ReadPace::book(int64_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  free_ = std::max(free_, Clock::now()) +
      std::chrono::duration_cast<Clock::duration>(
              std::chrono::duration<double>(nbytes * seconds_per_byte_));
  return free_;
}

ExpertReader::ExpertReader(int threads, bool direct, double pace_bytes_per_s)
    : direct_(direct),
      pace_(pace_bytes_per_s > 0 ? std::make_unique<ReadPace>(pace_bytes_per_s) : nullptr),
      pool_(std::make_unique<ThreadPool>(threads)) {}

void BusyMeter::begin() {
  std::lock_guard<std::mutex> lock(mu_);
  if (active_++ == 0) {
    since_ = Clock::now();
  }
}

void BusyMeter::end(int64_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  bytes_ += nbytes;
  if (--active_ == 0) {
    busy_ += Clock::now() - since_;
  }
}

std::pair<int64_t, double> BusyMeter::totals() {
  std::lock_guard<std::mutex> lock(mu_);
  auto busy = busy_ + (active_ > 0 ? Clock::now() - since_ : Clock::duration{0});
  return {bytes_, std::chrono::duration<double>(busy).count()};
}

void ExpertReader::pread_paced(const File& f, uint8_t* buf, int64_t n, int64_t offset) {
  meter_.begin();
  try {
    if (pace_) {
      auto done = pace_->book(n);
      pread_full(f, buf, n, offset);
      std::this_thread::sleep_until(done);
    } else {
      pread_full(f, buf, n, offset);
    }
  } catch (...) {
    meter_.end(0);
    throw;
  }
  meter_.end(n);
}

ExpertReader::~ExpertReader() {
  pool_.reset(); // join the threads before the files go
  for (auto& f : files_) {
    ::close(f.fd);
  }
}

int ExpertReader::open(const std::string& path) {
  int flags = O_RDONLY;
#ifdef O_DIRECT
  if (direct_) {
    flags |= O_DIRECT;
  }
#endif
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) {
    throw ReadError("cannot open " + path + ": " + std::strerror(errno));
  }
#ifdef POSIX_FADV_RANDOM
  // Experts are read in no particular order: kernel readahead would only
  // read bytes nobody asked for.
  if (!direct_) {
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  }
#endif
#ifdef __APPLE__
  if (direct_ && fcntl(fd, F_NOCACHE, 1) != 0) {
    int err = errno;
    ::close(fd);
    throw ReadError("cannot disable caching of " + path + ": " + std::strerror(err));
  }
#endif
  files_.push_back({fd, path});
  return static_cast<int>(files_.size()) - 1;
}

void ExpertReader::close() {
  // Prefetch reads still queued or running use the descriptors: let them
  // finish before the numbers can be reused by another open().
  pool_->drain();
  for (auto& f : files_) {
    ::close(f.fd);
  }
  files_.clear();
}

const File& ExpertReader::file(int handle) const {
  if (handle < 0 || handle >= static_cast<int>(files_.size())) {
    throw ReadError("unknown file handle " + std::to_string(handle));
  }
  return files_[handle];
}

void ExpertReader::read_piece(
    const File& f,
    int64_t record,
    int64_t begin,
    int64_t end,
    const std::vector<Segment>& segments,
    const int64_t* dst_row) {
  if (direct_) {
    // Uncached reads land in an aligned bounce buffer, then each segment's
    // share is copied to its slot.
    thread_local std::unique_ptr<AlignedBuffer> bounce;
    if (!bounce) {
      bounce = std::make_unique<AlignedBuffer>(kChunkBytes);
    }
    pread_paced(f, bounce->data, end - begin, record + begin);
    for (size_t j = 0; j < segments.size(); ++j) {
      int64_t a = std::max(begin, segments[j].offset);
      int64_t b = std::min(end, segments[j].offset + segments[j].nbytes);
      if (a < b) {
        auto* dst = reinterpret_cast<uint8_t*>(dst_row[j]);
        std::memcpy(dst + (a - segments[j].offset), bounce->data + (a - begin), b - a);
      }
    }
    return;
  }
  for (size_t j = 0; j < segments.size(); ++j) {
    int64_t a = std::max(begin, segments[j].offset);
    int64_t b = std::min(end, segments[j].offset + segments[j].nbytes);
    if (a < b) {
      auto* dst = reinterpret_cast<uint8_t*>(dst_row[j]);
      pread_paced(f, dst + (a - segments[j].offset), b - a, record + a);
    }
  }
}

std::vector<uint32_t> ExpertReader::read(
    int file_handle,
    const int64_t* offsets,
    size_t n,
    const std::vector<Segment>& segments,
    const int64_t* dst,
    const bool* checksum,
    int64_t stride) {
  const File& f = file(file_handle);
  check_segments(segments, stride);
  const size_t S = segments.size();
  int64_t used = 0;
  for (auto& s : segments) {
    used = std::max(used, s.offset + s.nbytes);
  }
  // Direct reads must cover whole aligned blocks; the stride is a multiple.
  int64_t span = direct_ ? std::min(stride, (used + kDirectAlignment - 1) /
                                        kDirectAlignment * kDirectAlignment)
                         : used;

  TaskGroup group(*pool_);
  bool inline_ = static_cast<int64_t>(n) * span < kInlineBytes;
  for (size_t i = 0; i < n; ++i) {
    for (int64_t a = 0; a < span; a += kChunkBytes) {
      int64_t b = std::min(span, a + kChunkBytes);
      const int64_t* row = dst + i * S;
      int64_t record = offsets[i];
      if (inline_) {
        read_piece(f, record, a, b, segments, row);
      } else {
        group.run([this, &f, record, a, b, &segments, row] {
          read_piece(f, record, a, b, segments, row);
        });
      }
    }
  }
  group.wait();

  std::vector<uint32_t> crcs(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (!checksum[i]) {
      continue;
    }
    auto crc_of = [&, i] {
      uint32_t c = 0;
      for (size_t j = 0; j < S; ++j) {
        c = crc32(c, reinterpret_cast<const uint8_t*>(dst[i * S + j]), segments[j].nbytes);
      }
      crcs[i] = c;
    };
    if (inline_) {
      crc_of();
    } else {
      group.run(crc_of);
    }
  }
  group.wait();
  return crcs;
}

void ExpertReader::read_record(int file_handle, int64_t offset, uint8_t* buffer, int64_t stride) {
  pread_paced(file(file_handle), buffer, stride, offset);
}

} // namespace mlx_streaming
