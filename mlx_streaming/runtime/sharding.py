"""A model sharded over ``mx.distributed`` groups as mlx-lm's ``sharded_load``
does it; each rank streams only its share (docs/distributed.md)."""

import json
import zlib
from dataclasses import dataclass, fields, replace
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generation_stream

from ..errors import ConfigError, FormatError, RankError, first_line
from ..format import Manifest, manifest_to_dict
from .stats import stats


@dataclass(frozen=True)
class Sharding:
    """The group a rank's model is sharded over, and its conversion's checksum."""

    pipeline: Optional[mx.distributed.Group] = None
    tensor: Optional[mx.distributed.Group] = None
    identity: int = 0

    @property
    def group(self) -> mx.distributed.Group:
        """The group whose ranks all load this model (for checks and stats)."""
        return self.tensor if self.tensor is not None else self.pipeline


def check_options(config, pipeline_group, tensor_group) -> None:
    """Refuse what a sharded model cannot run (MTP, both groups) before loading."""
    if config.mtp:
        raise ConfigError("MTP drafting does not run on a split model; draft with --draft "
                          "ngram or a draft model")
    if pipeline_group is not None and tensor_group is not None:
        raise ConfigError("pass either pipeline_group or tensor_group, not both: MLX's ring "
                          "and JACCL backends cannot split the ranks into both kinds of group, "
                          "and mlx-lm's pipeline over the same group hangs (docs/distributed.md)")


def choose(model: nn.Module, pipeline_group, tensor_group, model_type: str,
           manifest: Manifest, path) -> Sharding:
    """The group to shard ``model`` over as mlx-lm chooses it (the one given, else
    tensor parallel where the family can, else a pipeline), checked against the
    conversion."""
    has_pipeline = hasattr(model, "model") and hasattr(model.model, "pipeline")
    has_shard = hasattr(model, "shard")
    if pipeline_group is not None and not has_pipeline:
        raise ConfigError(f"{model_type}'s mlx-lm model has no model.pipeline(), so it cannot "
                          "run as a pipeline" + (": use tensor parallelism (--tensor-parallel)"
                                                 if has_shard else ""))
    if tensor_group is not None and not has_shard:
        raise ConfigError(f"{model_type}'s mlx-lm model has no shard(), so it cannot run "
                          "tensor parallel" + (": use a pipeline (--pipeline)"
                                               if has_pipeline else ""))
    if pipeline_group is None and tensor_group is None:
        if not (has_shard or has_pipeline):
            raise ConfigError(f"{model_type}'s mlx-lm model has neither shard() nor "
                              "model.pipeline(): it runs on one machine only")
        world = mx.distributed.init()
        pipeline_group, tensor_group = (None, world) if has_shard else (world, None)
    split = Sharding(pipeline_group, tensor_group, identity(manifest))
    if tensor_group is None and manifest.ranks:
        raise FormatError(f"{path} is a conversion for {manifest.tensor_parallel} "
                          "tensor-parallel ranks: run it tensor parallel (--tensor-parallel) on "
                          "as many ranks, or convert it again without --tensor-parallel to run "
                          "it as a pipeline")
    if tensor_group is not None and manifest.ranks and manifest.dense and \
            not manifest.dense_ranks:
        raise FormatError(f"{path} is a tensor-parallel conversion of an earlier mlx_streaming "
                          "(its dense layers are not split per rank): convert it again, with "
                          "--force")
    size = tensor_group.size() if tensor_group is not None else 1
    if manifest.tensor_parallel != size:
        how = (f"convert it with --tensor-parallel {size}" if size > 1
               else "convert it without --tensor-parallel to run it as a pipeline")
        raise FormatError(f"{path} was converted for {manifest.tensor_parallel} tensor-parallel "
                          f"rank(s), but {size} run tensor parallel here: {how}")
    return split


def same_on_ranks(config) -> dict:
    """The options every rank must load alike: those that change what the model
    computes (``StreamConfig`` fields marked ``same_on_ranks``)."""
    return {f.name: getattr(config, f.name) for f in fields(config)
            if f.metadata.get("same_on_ranks")}


def agree(model: Optional[nn.Module], group, failure: Optional[BaseException]) -> None:
    """Every rank's load, met once: outcome, conversion, options and prefill step
    gathered; all ranks stop, or all prefill in the smallest step. Raises the
    rank's own failure, or RankError, FormatError, ConfigError for another's."""
    runtime = model.streaming if model is not None else None
    identity = runtime.sharding.identity if runtime is not None else 0
    step = runtime.plan.prefill_step if runtime is not None else 0
    options = same_on_ranks(runtime.config) if runtime is not None else {}
    digest = _checksum(options)
    copies = runtime is not None and any(r.copies is not None for r in runtime.residencies)
    mine = [int(failure is None), identity >> 16, identity & 0xFFFF, step,
            digest >> 16, digest & 0xFFFF, int(copies)]
    try:
        everyone = all_gather_ints(mine, group)
    except RuntimeError as e:
        everyone, failure = None, failure or RankError(f"the ranks could not meet after loading "
                                                       f"({first_line(e)}): a rank is gone")
    try:
        if failure is not None:
            raise failure
        failed = [r for r, row in enumerate(everyone) if not row[0]]
        if failed:
            raise RankError(f"rank(s) {', '.join(map(str, failed))} could not load the model "
                            "(each says why); every rank stops")
        ids = [(row[1] << 16) | row[2] for row in everyone]
        for rank, value in enumerate(ids):
            if value != ids[0]:
                raise FormatError(
                    f"rank {rank}'s stream directory differs from rank 0's (manifest checksum "
                    f"{value:08x}, not {ids[0]:08x}): every rank must load the same "
                    f"conversion; copy rank 0's directory to rank {rank}'s machine")
        # Every rank saw the same digests: all gather the options, or none.
        if len({(row[4], row[5]) for row in everyone}) > 1:
            _check_same_options(options, group)
        if runtime.sharding.tensor is not None:
            _check_copies_on_every_rank([row[6] for row in everyone])
    except BaseException:
        if runtime is not None:
            runtime.close()
        raise
    runtime.plan = replace(runtime.plan, prefill_step=min(row[3] for row in everyone))


def _check_same_options(options: dict, group) -> None:
    """ConfigError naming the first option a rank loaded otherwise than rank 0."""
    try:
        everyone = gather(options, group)
    except RuntimeError as e:
        raise RankError(f"the ranks could not compare their options ({first_line(e)}): a "
                        "rank is gone") from None
    for rank, theirs in enumerate(everyone):
        for name, value in everyone[0].items():
            if theirs.get(name) != value:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"ranks differ in {name} (rank 0 {value!r}, rank {rank} "
                    f"{theirs.get(name)!r}), which changes what the split model computes: "
                    f"load every rank with the same {name} ({flag})")


def _check_copies_on_every_rank(copies: List[int]) -> None:
    """ConfigError where some tensor-parallel ranks read low-bit copies and others
    hold every expert: ranks choose the copies together, a collective per call."""
    if len(set(copies)) > 1:
        whole = [r for r, c in enumerate(copies) if not c]
        raise ConfigError(
            f"miss_bits: rank(s) {', '.join(map(str, whole))} hold every expert and read no "
            "low-bit copies while the others page: tensor-parallel ranks choose the copies "
            "together; give every rank a budget below the whole model (--cache-gb or "
            "--slots-per-layer), or leave miss_bits off")


def _checksum(options: dict) -> int:
    return zlib.crc32(json.dumps(options, sort_keys=True).encode()) & 0xFFFFFFFF


def identity(manifest: Manifest) -> int:
    """A checksum of what a conversion holds, not of where it came from."""
    text = json.dumps(manifest_to_dict(replace(manifest, source={})), sort_keys=True)
    return zlib.crc32(text.encode()) & 0xFFFFFFFF


# Collectives run on mlx-lm's generation stream (docs/design.md, "runtime/sharding.py").


def all_gather_ints(values: List[int], group) -> List[List[int]]:
    """Each rank's ``values`` (non-negative, below 2**31), by rank."""
    gathered = mx.distributed.all_gather(mx.array([values], dtype=mx.int32), group=group,
                                         stream=generation_stream)
    return gathered.tolist()


def apply_pipeline(model: nn.Module, sharding: Sharding) -> None:
    if sharding.pipeline is not None:
        model.model.pipeline(sharding.pipeline)


def rank_view(manifest: Manifest, model: nn.Module, sharding: Sharding) -> Manifest:
    """The manifest of what this rank streams (its slices, its stage's layers)."""
    layers, dense, low = manifest.layers, manifest.dense, manifest.low_bits
    if sharding.tensor is not None and manifest.ranks:
        rank = sharding.tensor.rank()
        layers = manifest.ranks[rank]
        dense = manifest.dense_ranks[rank] if manifest.dense_ranks else manifest.dense
        low = tuple(replace(c, layers=c.ranks[rank], ranks=()) for c in low)
    if sharding.pipeline is not None:
        start, end = model.model.start_idx, model.model.end_idx
        layers = tuple(spec for spec in layers if start <= spec.layer < end)
        dense = tuple(d for d in dense if start <= d.layer < end)
        low = tuple(replace(c, layers=tuple(spec for spec in c.layers if start <= spec.layer < end))
                    for c in low)
        if not layers:
            raise ConfigError(f"pipeline rank {sharding.pipeline.rank()}'s stage (layers "
                              f"{start} to {end - 1}) holds no MoE layer: use fewer ranks")
    # MTP layers do not run split; their blobs need not be on a rank's disk.
    return replace(manifest, layers=layers, dense=dense, ranks=(), dense_ranks=(), mtp=None,
                   low_bits=low)


def shard_spine(model: nn.Module, manifest: Manifest, sharding: Sharding) -> int:
    """Tensor parallel: the model's layers cut by ``shard()`` before any dense
    record is read (a rank's records hold its slices); returns the bytes of
    what the rank keeps of the resident spine."""
    model.shard(sharding.tensor)
    # Records and experts arrive later; their lazy inits are never evaluated.
    experts = tuple(f"{spec.module}." for spec in manifest.layers)
    records = {f"{d.prefix}.{s.name}" for d in manifest.dense for s in d.segments}
    kept = [(k, v) for k, v in tree_flatten(model.parameters())
            if not k.startswith(experts) and k not in records]
    # x * 1 is x to the bit, in arrays of their own: no view keeps a whole tensor.
    own = [(k, v * mx.array(1, dtype=v.dtype)) for k, v in kept]
    mx.eval([v for _, v in own])
    model.update(tree_unflatten(own))
    return sum(v.nbytes for _, v in own)


def gather(record: dict, group) -> List[dict]:
    """Each rank's ``record`` (JSON-serializable), by rank, on every rank."""
    data = json.dumps(record, default=float).encode()
    (sizes,) = zip(*all_gather_ints([len(data)], group))
    most = max(sizes)
    padded = mx.array(list(data + b" " * (most - len(data))), dtype=mx.uint8)[None]
    rows = mx.distributed.all_gather(padded, group=group, stream=generation_stream)
    return [json.loads(bytes(row[:n].tolist()).decode()) for row, n in zip(rows, sizes)]


def sharded_stats(model: nn.Module) -> List[dict]:
    """Every rank's ``stats(model)`` by rank (a collective); one machine: its own."""
    mine = stats(model)
    split = model.streaming.sharding
    if split is None:
        return [mine]
    return gather(mine, split.group)
