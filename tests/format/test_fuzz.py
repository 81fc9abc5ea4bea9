"""Fuzzing the parsers of untrusted files: random mutations of a real
manifest and of a real spine header give the package's own one-line
errors or exact output: never a crash, never another exception type.
Fixed seed (derandomize), so CI runs the same cases every time."""

import copy
import json
import shutil

import mlx_lm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx_streaming
from mlx_streaming.errors import StreamingError
from mlx_streaming.format import check_safetensors, manifest_path, read_manifest
from mlx_streaming.testing.helpers import assert_same_logits, logits_trace


def fuzz(cases: int):
    return settings(derandomize=True, deadline=None, database=None, max_examples=cases,
                    suppress_health_check=list(HealthCheck))


ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70),
    st.sampled_from([0, -1, 1, 7, 64, 16384, 10**12, 2**31, 2**32, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(["float32", "uint32", "bfloat16", "int8", "../x", "layer000.blob"]),
    st.lists(st.integers(-3, 70), max_size=4), st.just({}), st.just([]),
)


def paths_of(tree, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix, tree
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from paths_of(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from paths_of(v, prefix + (i,))


@st.composite
def mutated(draw, original):
    d = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in paths_of(d) if p]
        path = draw(st.sampled_from(paths))
        parent = d
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "copy"]))
        if action == "delete":
            del parent[path[-1]]
        elif action == "copy" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        else:
            parent[path[-1]] = draw(ODD_VALUES)
    return d


def fresh_copy(tmp_path_factory, qwen):
    dst = tmp_path_factory.mktemp("fuzz") / "stream"
    shutil.copytree(qwen[1], dst)
    return dst, json.loads(manifest_path(dst).read_text())


def test_fuzz_manifest_parsing(tmp_path_factory, qwen):
    stream, original = fresh_copy(tmp_path_factory, qwen)

    @fuzz(1000)
    @given(mutated(original))
    def case(d):
        manifest_path(stream).write_text(json.dumps(d))
        try:
            read_manifest(stream)
        except StreamingError as e:
            assert "\n" not in str(e)

    case()


def test_fuzz_manifest_load_is_exact_or_an_error(tmp_path_factory, qwen):
    stream, original = fresh_copy(tmp_path_factory, qwen)
    reference = logits_trace(mlx_lm.load(str(qwen[0]))[0], steps=4)
    layers_only = {"layers": original["layers"]}

    @fuzz(60)
    @given(mutated(layers_only), st.sampled_from([4, 8, 16]),
           st.sampled_from(["off", "next-layer"]))
    def case(d, slots, prefetch):
        manifest_path(stream).write_text(json.dumps({**original, **d}))
        try:
            with mlx_streaming.load(stream, slots_per_layer=slots, prefetch=prefetch) as (model, _):
                assert_same_logits(reference, logits_trace(model, steps=4))
        except StreamingError as e:
            assert "\n" not in str(e)

    case()


def test_fuzz_spine_header(tmp_path_factory, qwen):
    from mlx_streaming.runtime.model_spine import load_spine

    stream, _ = fresh_copy(tmp_path_factory, qwen)
    manifest = read_manifest(stream)
    spine = stream / "model.safetensors"
    data = spine.read_bytes()
    header_len = int.from_bytes(data[:8], "little")

    @fuzz(1500)
    @given(st.data())
    def case(draw):
        blob = bytearray(data)
        kind = draw.draw(st.sampled_from(["flip", "length", "truncate", "splice"]))
        if kind == "flip":
            for _ in range(draw.draw(st.integers(1, 8))):
                i = draw.draw(st.integers(0, 8 + header_len - 1))
                blob[i] = draw.draw(st.integers(0, 255))
        elif kind == "length":
            blob[:8] = draw.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
        elif kind == "truncate":
            del blob[draw.draw(st.integers(0, len(blob) - 1)):]
        else:
            text = blob[8 : 8 + header_len].decode("utf-8", "replace")
            numbers = [i for i, c in enumerate(text) if c.isdigit()]
            if numbers:
                i = draw.draw(st.sampled_from(numbers))
                new = str(draw.draw(st.integers(-10**6, 10**15)))
                text = (text[:i] + new + text[i + 1 :]).ljust(header_len)[:header_len]
                blob[8 : 8 + header_len] = text.encode("utf-8", "replace")[:header_len].ljust(
                    header_len)
        spine.write_bytes(blob)
        try:
            check_safetensors(spine)
            # A header that passes goes on to MLX and mlx-lm's model loader.
            load_spine(stream, manifest)
        except StreamingError as e:
            assert "\n" not in str(e)

    case()
