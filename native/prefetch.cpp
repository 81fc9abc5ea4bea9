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

int stage_predicted(const PrefetchTarget& target, const mx::array& ranked, int width,
                    const mx::array& table) {
  const size_t cols = ranked.shape(-1);
  const size_t rows = cols ? ranked.size() / cols : 0;
  const size_t num_experts = table.size();
  const int32_t* slots = table.data<int32_t>();
  // int32 and uint32 ids share their bit patterns for valid expert ids.
  const uint32_t* ids = reinterpret_cast<const uint32_t*>(ranked.data<int32_t>());
  // A verify call's rows are its tokens, and it needs the union of their
  // experts: those predicted for the most rows come first, then rank by
  // rank (every row's best prediction before any row's second), so that
  // under a budget the likeliest experts are read first.
  const size_t budget = std::max(0, target.budget.load(std::memory_order_relaxed));
  const size_t depth = std::min<size_t>(width, cols);
  std::vector<int64_t> order;  // distinct candidates, rank by rank
  std::vector<int> count(num_experts, 0);
  for (size_t j = 0; j < depth; ++j) {
    for (size_t r = 0; r < rows; ++r) {
      uint32_t e = ids[r * cols + j];
      if (e < num_experts && count[e]++ == 0) {
        order.push_back(e);
      }
    }
  }
  std::stable_sort(order.begin(), order.end(),
                   [&count](int64_t a, int64_t b) { return count[a] > count[b]; });
  std::vector<int64_t> wanted;
  for (size_t i = 0; i < order.size() && wanted.size() < budget; ++i) {
    if (slots[order[i]] < 0) {
      wanted.push_back(order[i]);
    }
  }
  std::vector<int64_t> offsets(wanted.size());
  for (size_t i = 0; i < wanted.size(); ++i) {
    offsets[i] = wanted[i] * target.stride;
  }
  return target.staging->stage(target.layer, target.file, wanted.data(), offsets.data(),
                               wanted.size());
}

mx::array prefetch_on_complete(
    const mx::array& ranked,
    int width,
    const mx::array& table,
    std::shared_ptr<PrefetchTarget> target,
    mx::StreamOrDevice s) {
  if ((ranked.dtype() != mx::int32 && ranked.dtype() != mx::uint32) ||
      table.dtype() != mx::int32) {
    throw std::invalid_argument(
        "prefetch_on_complete takes int32 or uint32 ids and an int32 table");
  }
  if (table.ndim() != 1 || ranked.ndim() < 1 || width < 1) {
    throw std::invalid_argument(
        "prefetch_on_complete: the table must be 1-D, the ids at least 1-D, width >= 1");
  }
  auto stream = mx::to_stream(s);
  // Row-contiguous ids let the callback read them as a flat buffer.
  auto ids = mx::contiguous(ranked, false, stream);
  return mx::array(
      mx::Shape{},
      mx::int32,
      std::make_shared<PrefetchOnComplete>(stream, std::move(target), width),
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
  encoder.dispatch(
      [ids = inputs[0], table = inputs[1], out, target = target_, width = width_]() mutable {
        out.data<int32_t>()[0] = stage_predicted(*target, ids, width, table);
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
      [ids = inputs[0], table = inputs[1], target = target_, width = width_](
          MTL::CommandBuffer*) { stage_predicted(*target, ids, width, table); });
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
