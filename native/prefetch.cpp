#include "prefetch.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

#ifdef _METAL_
#include "mlx/backend/metal/device.h"
#endif

namespace mlx_streaming {

int stage_predicted(const PrefetchTarget& target, const int32_t* predicted,
                    size_t n, const int32_t* table, size_t num_experts) {
  std::vector<int64_t> ids;
  ids.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    int32_t e = predicted[i];
    if (e >= 0 && static_cast<size_t>(e) < num_experts && table[e] < 0) {
      ids.push_back(e);
    }
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  std::vector<int64_t> offsets(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    offsets[i] = ids[i] * target.stride;
  }
  return target.staging->stage(target.layer, target.file, ids.data(), offsets.data(), ids.size());
}

mx::array prefetch_on_complete(
    const mx::array& predicted,
    const mx::array& table,
    std::shared_ptr<PrefetchTarget> target,
    mx::StreamOrDevice s) {
  if (predicted.dtype() != mx::int32 || table.dtype() != mx::int32) {
    throw std::invalid_argument("prefetch_on_complete takes int32 ids and table");
  }
  if (table.ndim() != 1) {
    throw std::invalid_argument("prefetch_on_complete: the table must be 1-D");
  }
  auto stream = mx::to_stream(s);
  // Contiguous inputs let the callback read them as flat int32 buffers.
  auto ids = mx::flatten(mx::contiguous(predicted, false, stream), stream);
  return mx::array(
      mx::Shape{},
      mx::int32,
      std::make_shared<PrefetchOnComplete>(stream, std::move(target)),
      {ids, table});
}

void PrefetchOnComplete::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_input_array(inputs[1]);
  encoder.set_output_array(out);
  // The task runs on the stream's thread once the prediction is computed:
  // the reads start right then, with no sync.
  encoder.dispatch([ids = inputs[0], table = inputs[1], out, target = target_]() mutable {
    out.data<int32_t>()[0] = stage_predicted(
        *target, ids.data<int32_t>(), ids.size(), table.data<int32_t>(), table.size());
  });
}

#ifdef _METAL_

void PrefetchOnComplete::eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) {
  // Unified memory: the output and inputs are readable from the CPU once
  // the command buffer that computes them completes.
  out.set_data(mx::allocator::malloc(out.nbytes()));
  std::memset(out.data<int32_t>(), 0, sizeof(int32_t));
  // The stream's queue runs in order: when the command buffer being encoded
  // completes, the kernels that computed the prediction have completed too.
  auto& encoder = mx::metal::get_command_encoder(stream());
  encoder.get_command_buffer()->addCompletedHandler(
      [ids = inputs[0], table = inputs[1], target = target_](MTL::CommandBuffer*) {
        stage_predicted(*target, ids.data<int32_t>(), ids.size(),
                        table.data<int32_t>(), table.size());
      });
}

#else

void PrefetchOnComplete::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  // Only the CPU and Metal paths exist; a CUDA build of MLX lands here.
  throw std::runtime_error(
      "prefetch_on_complete has no GPU implementation in this build; "
      "use prefetch='off' or the CPU device");
}

#endif

} // namespace mlx_streaming
