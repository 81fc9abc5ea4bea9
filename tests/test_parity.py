"""Exactness: every mlx-lm family with routed experts (``tiny.FAMILIES``;
``tiny_families.UNTESTED`` says which are left out and why), 4-bit and
float32, at the minimum, half and full pool, gives logits bit-identical to
mlx-lm running the same weights in memory, for prefill and 32 decode steps,
and the same greedy text."""

import pytest

from mlx_streaming.testing.families import FAMILIES
from mlx_streaming.testing.helpers import check_matches_resident, pool_sizes


@pytest.mark.parametrize("quantized", [True, False], ids=["q4", "f32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_mlx_lm(models, family, quantized):
    src, stream_dir = models.get(family, quantized)
    for slots in pool_sizes(stream_dir):
        check_matches_resident(src, stream_dir, slots_per_layer=slots)
