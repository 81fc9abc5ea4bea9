"""Find the routed-expert blocks of an mlx-lm model, and their routers.

Every mlx-lm MoE family builds its routed experts from ``SwitchGLU`` or
``SwitchMLP``; finding those modules is all the converter and the loader need
to know about a family. The router is only needed for prefetch: the block's
parent owns it, as a ``Linear`` with one output per expert (``gate``,
``router``) or, for DeepSeek, a gate module holding a ``[E, D]`` weight.
"""

from typing import Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from ..format import layer_in_path

EXPERT_BLOCK_TYPES = (SwitchGLU, SwitchMLP)


def find_expert_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Every ``SwitchGLU``/``SwitchMLP`` of ``model`` with its module path,
    in layer order."""
    blocks = [
        (path, m)
        for path, m in model.named_modules()
        if isinstance(m, EXPERT_BLOCK_TYPES)
    ]
    return sorted(blocks, key=lambda pm: _path_sort_key(pm[0]))


def _path_sort_key(path: str):
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def layer_index(path: str, ordinal: int) -> int:
    """The transformer layer a block sits in (the last integer in its path),
    or its ordinal among the expert blocks when the path has none."""
    index = layer_in_path(path)
    return ordinal if index is None else index


def num_experts(block: nn.Module) -> int:
    """Number of experts of a block, from the leading axis of its tensors."""
    return next(iter(tree_flatten(block.parameters())))[1].shape[0]


def get_module(model: nn.Module, path: str) -> nn.Module:
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    model.update_modules(tree_unflatten([(path, module)]))


def parent_path(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def is_router(module, num_experts: int, input_dims: int) -> bool:
    if isinstance(module, nn.QuantizedLinear):
        return module.weight.shape[0] == num_experts
    weight = module.get("weight") if isinstance(module, nn.Module) else None
    return (
        isinstance(weight, mx.array)
        and weight.ndim == 2
        and weight.shape == (num_experts, input_dims)
    )


class RouterScorer:
    """Scores a MoE block's experts for an input; the top scores are the
    experts the block's own router would most likely pick.

    Softmax routers are scored by their logits (softmax keeps the order);
    sigmoid routers with a selection bias (DeepSeek-V3, Kimi) by
    ``sigmoid(logits) + bias``. Group-limited selection is not modelled:
    the scores serve prediction, never the model's own routing.
    """

    def __init__(self, gate: nn.Module, bias_owner: Optional[nn.Module]):
        self.gate = gate
        self.bias_owner = bias_owner

    def __call__(self, x: mx.array) -> mx.array:
        if isinstance(self.gate, (nn.Linear, nn.QuantizedLinear)):
            logits = self.gate(x)
        else:
            logits = x @ self.gate["weight"].T
        if self.bias_owner is None:
            return logits
        bias = self.bias_owner["e_score_correction_bias"]
        return mx.sigmoid(logits.astype(mx.float32)) + bias

    @property
    def softmax(self) -> bool:
        """Whether the softmax of the scores is the router's own
        probability (else a sigmoid router: only the order means much)."""
        return self.bias_owner is None

    def probabilities(self, x: mx.array) -> mx.array:
        """Softmax of the scores: for softmax routers the router's own
        probabilities; for the others a normalised ranking signal."""
        return mx.softmax(self(x).astype(mx.float32), axis=-1)


def find_router(
    model: nn.Module, block_path: str, num_experts: int, input_dims: int
) -> Optional[RouterScorer]:
    """The scorer of the router that feeds the block at ``block_path``, or
    None when its parent has no recognisable router taking ``input_dims``
    inputs (e.g. latent MoE, whose experts see a projected input)."""
    parent = get_module(model, parent_path(block_path))
    for _, child in _routers(parent, num_experts, input_dims):
        owner = None
        for candidate in (child, parent):
            if "e_score_correction_bias" in candidate:
                owner = candidate
                break
        return RouterScorer(child, owner)
    return None


def _routers(parent: nn.Module, num_experts: int, input_dims: int):
    """``(name, module)`` of the children of ``parent`` that look like the
    router of its ``num_experts``-expert block taking ``input_dims``."""
    for name, child in parent.children().items():
        if isinstance(child, nn.Module) and is_router(child, num_experts, input_dims):
            if isinstance(child, nn.QuantizedLinear):
                if child.scales.shape[-1] * child.group_size != input_dims:
                    continue
            yield name, child


def router_paths(model: nn.Module, block_path: str, num_experts: int,
                 input_dims: int) -> List[str]:
    """Module paths of the routers next to the block at ``block_path``."""
    parent = parent_path(block_path)
    return [f"{parent}.{name}" for name, _ in
            _routers(get_module(model, parent), num_experts, input_dims)]


def layers_path(block_path: str) -> Optional[str]:
    """The path of the list of transformer layers a block sits in: its path
    up to the first integer (``model.layers`` of ``model.layers.3.mlp.x``)."""
    parts = block_path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i]) if i else None
    return None


def input_dims_of(block: nn.Module) -> int:
    """Width of the hidden state a block takes."""
    first = block.gate_proj if isinstance(block, SwitchGLU) else block.fc1
    if "scales" in first:
        return first.scales.shape[-1] * first.group_size
    return first.weight.shape[-1]


def projections(block: nn.Module) -> List[str]:
    """Names of the expert projections of a block, in call order."""
    if isinstance(block, SwitchGLU):
        return ["gate_proj", "up_proj", "down_proj"]
    return ["fc1", "fc2"]


def quantization_of(block: nn.Module) -> dict:
    """Per projection: ``{bits, group_size, mode}`` or None if unquantized."""
    out = {}
    for name in projections(block):
        proj = block[name]
        if "scales" in proj:
            q = {"bits": proj.bits, "group_size": proj.group_size, "mode": proj.mode}
            if proj.get("global_scale") is not None:
                q["global_scale"] = True
            out[name] = q
        else:
            out[name] = None
    return out


ScoreFn = Callable[[mx.array], mx.array]


class Routed(Exception):
    def __init__(self, top_k: int):
        self.top_k = top_k


class RoutingProbe(nn.Module):
    """Stands in for an expert block and stops the parent's call as soon as
    the router hands it the expert ids."""

    def __call__(self, x, indices, *args, **kwargs):
        raise Routed(int(indices.shape[-1]))


def probe_top_k(model: nn.Module, block_path: str, widths) -> Optional[int]:
    """Experts per token of the block at ``block_path``, read off the
    instantiated model: its parent (the MoE module) is called on a dummy
    input of each width in ``widths`` until its router hands the block
    expert ids. Shapes are known without evaluation, so no weight is read
    but the router's. None when the parent cannot be called that way.

    Families name this number differently in their configs (``moe_k``,
    ``moe_topk``, ``num_experts_per_tok`` ...); the model knows it.
    """
    parent = get_module(model, parent_path(block_path))
    name = block_path.rsplit(".", 1)[-1]
    if not isinstance(parent, nn.Module) or name not in parent:
        return None
    original = parent[name]
    setattr(parent, name, RoutingProbe())
    try:
        for width in dict.fromkeys(w for w in widths if w):
            try:
                parent(mx.zeros((1, 1, width)))
            except Routed as routed:
                return routed.top_k
            except Exception:
                continue
    finally:
        setattr(parent, name, original)
    return None
