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
    bool background = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto background_ok = [this] {
        return !background_.empty() && running_background_ < kMaxBackground;
      };
      cv_.wait(lock, [&] { return stop_ || !urgent_.empty() || background_ok(); });
      if (urgent_.empty() && !background_ok()) {
        return; // stopping; a worker still running a background task drains the rest
      }
      background = urgent_.empty();
      auto& queue = background ? background_ : urgent_;
      task = std::move(queue.front());
      queue.pop_front();
      ++running_;
      running_background_ += background;
    }
    task();
    {
      std::lock_guard<std::mutex> lock(mu_);
      running_background_ -= background;
      if (--running_ == 0 && urgent_.empty() && background_.empty()) {
        idle_.notify_all();
      }
    }
    if (background) {
      cv_.notify_one(); // the next background task may start
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
