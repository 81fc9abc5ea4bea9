"""The converter: generic discovery, quantization, bounded memory and crash
safety."""

import json
import signal
import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

import mlx_streaming
from mlx_streaming.conversion.local import convert
from mlx_streaming.errors import ConversionError, FormatError
from mlx_streaming.format import CONVERT_STATE_NAME, manifest_path, read_manifest
from mlx_streaming.testing import tiny
from mlx_streaming.testing.helpers import VOCAB, check_matches_resident


def test_package_exports_the_convert_function():
    import mlx_streaming.conversion.local  # noqa: F401

    assert callable(mlx_streaming.convert)


def test_non_moe_model_is_refused(tmp_path, tokenizer_dir):
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=1,
                  intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                  rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0)
    src = tiny.save_mlx_model(tiny.build_model(config), config, tmp_path / "llama", tokenizer_dir)
    with pytest.raises(ConversionError, match="not a MoE model"):
        convert(src, tmp_path / "out", progress=False)
    assert not manifest_path(tmp_path / "out").exists()


def test_missing_source_is_refused(tmp_path):
    with pytest.raises(ConversionError, match="has no config.json"):
        convert(tmp_path, tmp_path / "out", progress=False)


def test_quantize_while_converting_matches_mlx_lm(tmp_path, tokenizer_dir, models):
    config = tiny.tiny_config("qwen3_moe", VOCAB)
    model = tiny.build_model(config, seed=3)
    float_src = tiny.save_mlx_model(model, config, tmp_path / "f32", tokenizer_dir)
    # The reference: mlx-lm's own quantizer on the same weights.
    quant_src = tiny.save_mlx_model(model, config, tmp_path / "q4", tokenizer_dir, quantize=True)
    stream_dir = convert(float_src, tmp_path / "stream", quantize=True, progress=False)
    assert read_manifest(stream_dir).layers[0].quantization["up_proj"]["bits"] == 4
    check_matches_resident(quant_src, stream_dir, slots_per_layer=8)


def test_already_quantized_with_q_is_refused(qwen, tmp_path):
    with pytest.raises(ConversionError, match="already quantized"):
        convert(qwen[0], tmp_path / "out", quantize=True, progress=False)


def test_peak_memory_is_about_one_layer(tmp_path, tokenizer_dir):
    config = tiny.tiny_config("qwen3_moe", VOCAB, num_hidden_layers=8, num_experts=32)
    src = tiny.save_mlx_model(tiny.build_model(config), config, tmp_path / "src", tokenizer_dir)
    mx.clear_cache()
    mx.reset_peak_memory()
    stream_dir = convert(src, tmp_path / "stream", progress=False)
    peak = mx.get_peak_memory()
    manifest = read_manifest(stream_dir)
    layer = manifest.layers[0].expert_nbytes * manifest.layers[0].num_experts
    spine = sum(f.stat().st_size for f in stream_dir.glob("model*.safetensors"))
    assert manifest.expert_nbytes == 8 * layer
    assert peak < 2 * layer + 2 * spine, (peak, layer, spine)


def test_interrupted_conversion_never_loads_and_resumes(tmp_path, models):
    src, _ = models.get("qwen3_moe", quantized=True)
    dst = tmp_path / "stream"

    class Crash(Exception):
        pass

    def crash_after_first(spec):
        raise Crash()

    with pytest.raises(Crash):
        convert(src, dst, on_layer=crash_after_first, progress=False)
    assert (dst / CONVERT_STATE_NAME).exists()
    with pytest.raises(FormatError, match="did not finish.*again"):
        mlx_streaming.load(dst)
    first = dst / "experts" / "layer000.blob"
    mtime = first.stat().st_mtime_ns
    # A half-written blob of another layer is redone, not trusted.
    (dst / "experts" / "layer001.blob").write_bytes(b"partial")
    convert(src, dst, progress=False)
    assert first.stat().st_mtime_ns == mtime, "the finished layer was redone"
    assert not (dst / CONVERT_STATE_NAME).exists()
    check_matches_resident(src, dst, slots_per_layer=4)


def test_killed_conversion_resumes(tmp_path, models):
    """SIGKILL in the middle of a conversion (after its first layer)."""
    src, _ = models.get("qwen3_moe", quantized=True)
    dst = tmp_path / "stream"
    script = textwrap.dedent(f"""
        import os, signal
        from mlx_streaming.conversion.local import convert
        convert({str(src)!r}, {str(dst)!r}, progress=False,
                on_layer=lambda spec: os.kill(os.getpid(), signal.SIGKILL))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    assert not manifest_path(dst).exists()
    with pytest.raises(FormatError):
        mlx_streaming.load(dst)
    convert(src, dst, progress=False)
    check_matches_resident(src, dst, slots_per_layer=4)


def test_reconvert_is_a_no_op_and_other_models_need_force(tmp_path, models):
    src, _ = models.get("qwen3_moe", quantized=True)
    other, _ = models.get("mixtral", quantized=True)
    dst = convert(src, tmp_path / "stream", progress=False)
    mtime = manifest_path(dst).stat().st_mtime_ns
    convert(src, dst, progress=False)
    assert manifest_path(dst).stat().st_mtime_ns == mtime
    with pytest.raises(ConversionError, match="--force"):
        convert(other, dst, progress=False)
    convert(other, dst, force=True, progress=False)
    assert read_manifest(dst).layers[0].module.endswith("block_sparse_moe.switch_mlp")
    check_matches_resident(other, dst, slots_per_layer=2)


def test_synthetic_model_written_directly_equals_its_conversion(tmp_path, tokenizer_dir):
    """make_synthetic's two outputs: a stream directory written layer by
    layer, and an mlx-lm directory that convert() turns into the same one;
    the converted one streams exactly like mlx-lm runs it."""
    from mlx_streaming.testing import synthetic

    sizes = dict(hidden_size=128, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=64)
    direct = synthetic.make_synthetic(tmp_path / "direct", tokenizer_dir, **sizes)
    mlx_dir = synthetic.make_synthetic(tmp_path / "mlx", tokenizer_dir, fmt="mlx-lm", **sizes)
    converted = convert(mlx_dir, tmp_path / "converted", progress=False)

    a, b = read_manifest(direct), read_manifest(converted)
    assert [spec.file for spec in a.layers] == [spec.file for spec in b.layers]
    for la, lb in zip(a.layers, b.layers):
        assert (la.stride, la.segments, la.checksums) == (lb.stride, lb.segments, lb.checksums)
        blob = lambda d, spec: (d / "experts" / spec.file).read_bytes()  # noqa: E731
        assert blob(direct, la) == blob(converted, lb)
    check_matches_resident(mlx_dir, converted, slots_per_layer=2)


@pytest.mark.parametrize("options, message", [
    (dict(q_bits=0), "--q-bits must be one of 2, 3, 4, 5, 6, 8"),
    (dict(q_bits=7), "--q-bits must be one of"),
    (dict(q_group_size=0), "--q-group-size must be one of 32, 64, 128"),
    (dict(q_group_size=7), "--q-group-size must be one of"),
    (dict(q_mode="mxfp4", q_bits=8), "--q-bits must be one of 4 for mxfp4"),
])
def test_quantization_settings_mlx_does_not_take_are_refused(models, tmp_path, options,
                                                             message):
    """A 0 silently became mlx-lm's default; a group size of 7 wrote a config
    claiming it while the experts stayed float."""
    src, _ = models.get("qwen3_moe", quantized=False)
    with pytest.raises(ConversionError, match=message):
        convert(src, tmp_path / "out", quantize=True, progress=False, **options)
    assert not (tmp_path / "out").exists()


def test_a_group_size_that_leaves_the_experts_float_is_refused(tmp_path, tokenizer_dir):
    # Expert inputs of 96 (the hidden size): divisible by 32, not by 64.
    config = tiny.tiny_config("qwen3_moe", VOCAB, hidden_size=96, num_attention_heads=3,
                              num_key_value_heads=1, head_dim=32)
    src = tiny.save_mlx_model(tiny.build_model(config), config, tmp_path / "m", tokenizer_dir)
    with pytest.raises(ConversionError, match="does not divide the inputs of the experts.*"
                                              r"smaller one \(32 or 64\)"):
        convert(src, tmp_path / "out", quantize=True, q_group_size=128, progress=False)


@pytest.mark.parametrize("flags, says", [
    (["--q-bits", "8"], "--q-bits is a quantization setting: add -q"),
    (["--q-mode", "mxfp4"], "--q-mode is a quantization setting: add -q"),
    (["--upload", ""], "--upload '' is not a repo id"),
    (["--upload", "org/x", "--endpoint", "notaurl"], "--endpoint 'notaurl' is not an http"),
    (["--endpoint", "http://127.0.0.1:1"], "settings of --upload"),
])
def test_convert_flags_that_would_be_ignored_are_refused(qwen, tmp_path, capsys, flags, says):
    """Each was ignored, or converted and then skipped the upload, exit 0."""
    from mlx_streaming.conversion import command

    out = tmp_path / "s"
    assert command.main(["--model", str(qwen[0]), "--out", str(out), "--no-progress", *flags]) == 1
    assert says in capsys.readouterr().err and not out.exists()


def test_a_quantization_mode_brings_its_own_defaults(models, tmp_path):
    """``-q --q-mode mxfp4`` alone was refused: the group size 64 it
    defaulted to is affine's."""
    from mlx_streaming.conversion import command

    src, _ = models.get("qwen3_moe", quantized=False)
    out = tmp_path / "s"
    assert command.main(["--model", str(src), "--out", str(out), "--no-progress", "-q",
                     "--q-mode", "mxfp4"]) == 0
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert quantization["mode"] == "mxfp4" and quantization["group_size"] == 32


def test_half_precision_experts_warn_at_convert_and_are_refused_on_the_cpu(models, tmp_path):
    """MLX's CPU backend computes unquantized experts in float32 only: a
    float16 conversion without -q warns, and loading it there is one line,
    not a RuntimeError at the first token."""
    src, _ = models.get("qwen3_moe", quantized=False)
    with pytest.warns(RuntimeWarning, match="CPU backend cannot compute"):
        dst = convert(src, tmp_path / "f16", dtype="float16", progress=False)
    with pytest.raises(FormatError, match="unquantized float16.*convert the model again"):
        mlx_streaming.load(dst, slots_per_layer=4)
