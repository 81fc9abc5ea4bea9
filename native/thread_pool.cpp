#include "thread_pool.h"

#include "reader.h"

namespace mlx_streaming {

namespace {
// Set on a worker whose task released the last owner of its pool: the pool
// is gone, so the worker must leave without touching it again.
thread_local bool t_pool_destroyed = false;
} // namespace

ThreadPool::ThreadPool(int threads) {
  for (int i = 0; i < threads; ++i) {
    workers_.emplace_back([this] { work(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) {
    // The last owner may let go from inside a task: that worker cannot join
    // itself, and it exits once the task returns since stop_ is set.
    if (w.get_id() == std::this_thread::get_id()) {
      t_pool_destroyed = true;
      w.detach();
    } else {
      w.join();
    }
  }
}

void ThreadPool::submit(std::function<void()> task, bool urgent) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    (urgent ? urgent_ : background_).push_back(std::move(task));
  }
  cv_.notify_one();
}

void ThreadPool::work() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] {
        return stop_ || !urgent_.empty() || !background_.empty();
      });
      auto& queue = urgent_.empty() ? background_ : urgent_;
      if (queue.empty()) {
        return; // stopping and nothing left to do
      }
      task = std::move(queue.front());
      queue.pop_front();
      ++running_;
    }
    task();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--running_ == 0 && urgent_.empty() && background_.empty()) {
        idle_.notify_all();
      }
    }
    task = nullptr; // may release the last owner of this pool
    if (t_pool_destroyed) {
      return;
    }
  }
}

void ThreadPool::drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [this] { return running_ == 0 && urgent_.empty() && background_.empty(); });
}

void TaskGroup::run(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
  }
  pool_.submit(
      [this, task = std::move(task)] {
        std::string error;
        try {
          task();
        } catch (const std::exception& e) {
          error = e.what();
        }
        std::lock_guard<std::mutex> lock(mu_);
        if (!error.empty() && error_.empty()) {
          error_ = error;
        }
        if (--pending_ == 0) {
          cv_.notify_all();
        }
      },
      /* urgent = */ true);
}

void TaskGroup::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return pending_ == 0; });
  if (!error_.empty()) {
    throw ReadError(error_);
  }
}

} // namespace mlx_streaming
