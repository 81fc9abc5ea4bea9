// A persistent pool of I/O threads with two queues: demand reads (the
// forward pass is waiting for them) always run before prefetch reads, and
// prefetch reads run one at a time, in the order queued (best prediction
// first): the likeliest finishes first, a demand read waits behind at most
// one, and reads not started can still be cancelled when their layer comes.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mlx_streaming {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void submit(std::function<void()> task, bool urgent);
  // Waits until both queues are empty and no task is running.
  void drain();
  int size() const {
    return static_cast<int>(workers_.size());
  }

 private:
  void work();

  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> urgent_;
  std::deque<std::function<void()>> background_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_;
  int running_ = 0;
  int running_background_ = 0;
  static constexpr int kMaxBackground = 1;
  bool stop_ = false;
};

// Runs a batch of tasks on the pool and waits for all of them; the first
// exception message is rethrown by wait() as a ReadError.
class TaskGroup {
 public:
  explicit TaskGroup(ThreadPool& pool) : pool_(pool) {}
  void run(std::function<void()> task);
  void wait();

 private:
  ThreadPool& pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;
  std::string error_;
};

} // namespace mlx_streaming
