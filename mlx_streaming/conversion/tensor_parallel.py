"""Tensor-parallel conversion: each rank's slice of every expert, cut by the
family's own ``shard()`` (mlx-lm's), written to blobs of that rank's own.

A rank then reads its whole record in one aligned read and holds nothing
of the other ranks' slices; its disk needs only its own files.
"""

from typing import Callable, List

import mlx.nn as nn

from ..errors import ConversionError

# More ranks than this is a typo, not a cluster of Macs.
MAX_RANKS = 64


class ConversionGroup:
    """The rank and size a family's ``shard()`` asks of a distributed group,
    without one: the converter cuts every rank's slices in one process."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def check_ranks(ranks) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise ConversionError(f"--tensor-parallel must be a number of ranks from 1 to "
                              f"{MAX_RANKS}, got {ranks!r}")


def rank_file(layer: int, rank: int, ranks: int) -> str:
    return f"layer{layer:03d}.rank{rank}of{ranks}.blob"


def rank_models(load: Callable[[], nn.Module], ranks: int, model_type: str) -> List[nn.Module]:
    """One lazily loaded model per rank, sharded as rank ``r`` of ``ranks``
    by the family's ``shard()``; nothing is read until a layer is written.

    Raises:
        ConversionError: the family has no ``shard()``, or its dimensions do
            not divide into ``ranks``.
    """
    models = []
    for rank in range(ranks):
        model = load()
        if not hasattr(model, "shard"):
            raise ConversionError(
                f"{model_type}'s mlx-lm model has no shard(), so its experts cannot be split "
                "for tensor parallelism; convert without --tensor-parallel (pipeline "
                "parallelism needs no conversion, where the family has pipeline())")
        try:
            model.shard(ConversionGroup(ranks, rank))
        except (ValueError, ZeroDivisionError) as e:
            raise ConversionError(
                f"{model_type} cannot be split into {ranks} tensor-parallel ranks ({e}): the "
                "attention heads, every expert's intermediate size and its quantization "
                "groups must divide by the number of ranks") from None
        models.append(model)
    return models
