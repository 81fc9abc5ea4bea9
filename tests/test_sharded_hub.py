"""A tensor-parallel conversion served by the local Hub stand-in, loaded by
repo id on two ranks: bit-identical to mlx-lm's ``sharded_load`` of the
source, each rank fetching only its own slices of the experts it misses."""

import json
import re
from pathlib import Path

import pytest
from test_sharded import SPLITTABLE, launch

from helpers import VOCAB
from mlx_streaming.conversion.local import convert
from mlx_streaming.format import read_manifest
from mlx_streaming.testing import tiny
from mlx_streaming.testing.hubserver import HubServer

RANK_BLOB = re.compile(r"experts/layer\d+\.rank(\d)of2\.blob$")


def _cached_blobs(cache: Path) -> set:
    """The expert blobs whose records a rank's disk cache holds."""
    return {p.name for p in (cache / "records").rglob("*.blob") if p.is_dir()}


def _source(models, family: str, mode: str, root: Path) -> Path:
    """A 4-bit mlx-lm model of ``family``, its weights in ``mode``."""
    if mode == "affine":
        return models.get(family, True, **SPLITTABLE)[0]
    config = tiny.tiny_config(family, VOCAB, **SPLITTABLE)
    return tiny.save_mlx_model(tiny.build_model(config), config, root / "src", models.tokenizer_dir,
                               quantize=True, group_size=32, bits=4, mode=mode)


@pytest.mark.parametrize("family, mode", [("qwen3_moe", "affine"), ("deepseek_v3", "affine"),
                                          ("kimi_k3", "mxfp4")])
def test_a_tensor_parallel_repo_is_mlx_lms_and_each_rank_fetches_its_slices(
        models, family, mode, tmp_path):
    src = _source(models, family, mode, tmp_path)
    tp = convert(src, tmp_path / "tp2", tensor_parallel=2, progress=False)
    with HubServer({"org/tp": tp}) as server:
        options = json.dumps({"endpoint": server.url,
                              "disk_cache_dir": str(tmp_path / "cache-{rank}")})
        results = launch(tmp_path, "--source", src, "--model", "org/tp", "--mode", "tensor",
                         "--slots", "4", "--options", options)
        gets = [r for r in server.log if r.method == "GET"]
    for rank, result in enumerate(results):
        assert "error" not in result, result
        assert result["pools"]["4"]["same"], f"rank {rank}: logits differ from mlx-lm's"
        blobs = _cached_blobs(tmp_path / f"cache-{rank}")
        assert blobs and all(RANK_BLOB.search(f"experts/{b}").group(1) == str(rank)
                             for b in blobs), (rank, sorted(blobs))
    # Every expert read was a range of one rank's blob; none of a whole blob.
    expert_gets = [r for r in gets if r.path.startswith("experts/layer")]
    assert expert_gets and all(RANK_BLOB.search(r.path) and r.range is not None
                               for r in expert_gets)
    manifest = read_manifest(tp)
    if mode != "affine":
        assert {spec.quantization["gate_proj"]["mode"] for spec in manifest.layers} == {mode}
    assert {r.path.rsplit("/", 1)[1] for r in expert_gets} <= {
        spec.file for layers in manifest.ranks for spec in layers}
