// prefetch_on_complete: an MLX primitive whose evaluation starts the reads
// of predicted experts. It runs when the device has computed the
// prediction, inside the graph, so prefetch adds no host sync.
#pragma once

#include <memory>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "staging.h"

namespace mlx_streaming {

namespace mx = mlx::core;

// `predicted`: int32 expert ids [..., W] of the next layer; `table`: its
// int32 expert-to-slot table (-1: not resident). Stages every predicted
// expert that is not resident. Returns an int32 scalar: the number of
// reads issued (on the CPU backend; 0 on Metal, where the reads start in a
// command-buffer completion handler after the value is produced).
mx::array prefetch_on_complete(
    const mx::array& predicted,
    const mx::array& table,
    std::shared_ptr<PrefetchTarget> target,
    mx::StreamOrDevice s = {});

class PrefetchOnComplete : public mx::UnaryPrimitive {
 public:
  PrefetchOnComplete(mx::Stream stream, std::shared_ptr<PrefetchTarget> target)
      : mx::UnaryPrimitive(stream), target_(std::move(target)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "PrefetchOnComplete";
  }

 private:
  std::shared_ptr<PrefetchTarget> target_;
};

// Stage the predicted experts that the table says are not resident.
int stage_predicted(const PrefetchTarget& target, const int32_t* predicted,
                    size_t n, const int32_t* table, size_t num_experts);

} // namespace mlx_streaming
