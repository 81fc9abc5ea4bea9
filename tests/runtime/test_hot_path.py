"""One decode token's paged call, followed: the modules it enters are the
few that docs/design.md walks through, and the path is chosen at load and
reported."""

import re
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_streaming
from mlx_streaming.runtime.residency import HotPath, choose_path
from mlx_streaming.testing.helpers import EXT, PROMPT

PACKAGE = Path(mlx_streaming.__file__).resolve().parent
DESIGN = PACKAGE.parent / "docs" / "design.md"
MAX_MODULES = 6


def _modules_of_one_token(model) -> set:
    """The package modules whose Python code one greedy decode step runs,
    on any thread (the prefill and two steps before it warm everything)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = model(mx.array([PROMPT]), cache=cache)
    for _ in range(3):
        token = mx.argmax(y[:, -1], axis=-1, keepdims=True)
        y = model(token, cache=cache)
        mx.eval(y)
    token = mx.argmax(y[:, -1], axis=-1, keepdims=True)
    entered = set()

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(str(PACKAGE)):
            entered.add(Path(name).relative_to(PACKAGE).as_posix())

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        mx.eval(model(token, cache=cache))
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return entered


def _life_of_a_decode_token() -> str:
    text = DESIGN.read_text()
    return re.search(r"## The life of a decode token\n(.*?)\n## ", text, re.S).group(1)


@pytest.mark.skipif(EXT is None or mx.default_device() != mx.cpu,
                    reason="the default path is the native step inside the graph (CPU)")
def test_a_paged_decode_token_enters_the_few_modules_the_design_names(qwen):
    with mlx_streaming.load(qwen[1], slots_per_layer=4) as (model, _):
        entered = _modules_of_one_token(model)
        path = mlx_streaming.stats(model)["path"]
    assert path["kind"] == "native in graph"
    assert len(entered) <= MAX_MODULES, sorted(entered)
    life = _life_of_a_decode_token()
    assert all(f"`{name}`" in life or f"`{name[:-3]}" in life for name in entered), \
        (sorted(entered), "each module entered is named in design.md's walk-through")


def test_the_path_is_chosen_once_and_reported(qwen, tmp_path):
    """Resident, native or the Python reference, with the reason, as
    ``choose_path`` picked it at load; the blocks run what it names."""
    with mlx_streaming.load(qwen[1]) as (model, _):
        assert mlx_streaming.stats(model)["path"]["kind"] == "resident"
    with mlx_streaming.load(qwen[1], slots_per_layer=4,
                            trace=str(tmp_path / "t.jsonl")) as (model, _):
        path = mlx_streaming.stats(model)["path"]
        assert path["kind"] == "python" and "trace" in path["why"]
        runtime = model.streaming
        assert runtime.path == HotPath(**path) == choose_path(runtime)
        assert {type(s).__name__ for s in runtime.stores} == {"ExpertStore"}
    with mlx_streaming.load(qwen[1], slots_per_layer=4, io="python") as (model, _):
        assert "reader has no native step" in mlx_streaming.stats(model)["path"]["why"]
