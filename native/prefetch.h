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

// `ranked`: expert ids of the next layer [..., E'] (int32 or uint32), best
// first in each row (an argsort's output, unsliced); `table`: its int32
// expert-to-slot table (-1: not resident). Stages the predicted experts that
// are not resident, best ranks first, at most the target's budget. Returns an int32 scalar: the
// number of reads issued (on the CPU backend; 0 on Metal, where the reads
// start in a command-buffer completion handler after the value is made).
mx::array prefetch_on_complete(
    const mx::array& ranked,
    int width,
    const mx::array& table,
    std::shared_ptr<PrefetchTarget> target,
    mx::StreamOrDevice s = {});

class PrefetchOnComplete : public mx::UnaryPrimitive {
 public:
  PrefetchOnComplete(mx::Stream stream, std::shared_ptr<PrefetchTarget> target, int width)
      : mx::UnaryPrimitive(stream), target_(std::move(target)), width_(width) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return "PrefetchOnComplete";
  }

 private:
  std::shared_ptr<PrefetchTarget> target_;
  int width_;
};

// Stage the first `width` experts of each row of `ranked` ([rows, cols])
// that the table says are not resident, in rank order, up to the budget.
int stage_predicted(const PrefetchTarget& target, const mx::array& ranked, int width,
                    const mx::array& table);

} // namespace mlx_streaming
