"""Find the routed-expert blocks of an mlx-lm model (its ``SwitchGLU`` and
``SwitchMLP``), and their routers (docs/design.md, "models/discover.py")."""

from typing import Callable, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from ..format import layer_in_path

EXPERT_BLOCK_TYPES = (SwitchGLU, SwitchMLP)


def find_expert_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Every ``SwitchGLU``/``SwitchMLP`` of ``model`` with its path, in layer order."""
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
    """Scores a MoE block's experts for an input as its router ranks them, for
    prediction only (docs/design.md, "models/discover.py")."""

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
        """Whether the scores' softmax is the router's own probability (else sigmoid)."""
        return self.bias_owner is None

    def probabilities(self, x: mx.array) -> mx.array:
        """Softmax of the scores: a softmax router's probabilities, else a ranking."""
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
    """``(name, module)`` of ``parent``'s children that look like its block's router."""
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
    """The path of a block's layer list: up to the first integer (``model.layers``)."""
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
    """Stands in for an expert block; raises ``Routed`` with the router's top-k."""

    def __call__(self, x, indices, *args, **kwargs):
        raise Routed(int(indices.shape[-1]))


def probe_top_k(model: nn.Module, block_path: str, widths) -> Optional[int]:
    """Experts per token of the block at ``block_path``, read off the model: its
    parent is called on zeros of each width until the router hands the block
    ids (no weight but the router's is read); None when it cannot be so called."""
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
