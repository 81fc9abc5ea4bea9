"""Command lines: they run, report their numbers, and turn bad input into
one line that says what to do, never a traceback."""

import json
import subprocess
import sys

from mlx_streaming.format import read_manifest
from mlx_streaming.testing.helpers import assert_one_line_error, run


def test_generate_prints_numbers_and_writes_json(qwen, tmp_path):
    _, stream_dir = qwen
    out = tmp_path / "stats.json"
    proc = run("mlx_streaming.generate", "--model", str(stream_dir), "--prompt", "def f(x):",
               "--max-tokens", "12", "--slots-per-layer", "6", "--stats-json", str(out))
    assert "decode: 12 tokens" in proc.stderr
    assert "reader: native (native extension)" in proc.stderr
    assert "hit rate" in proc.stderr and "GB read" in proc.stderr and "peak memory" in proc.stderr
    summary = json.loads(out.read_text())["summary"]
    for key in ("prompt_tps", "generation_tps", "hit_rate", "gb_read", "read_gb_per_s",
                "peak_memory_gb"):
        assert key in summary
    assert summary["generation_tokens"] == 12
    assert summary["slots_per_layer"] == 6


def test_console_script_dispatches(qwen):
    proc = run("mlx_streaming", "check", str(qwen[1]))
    assert "match their checksums" in proc.stdout
    proc = run("mlx_streaming", "serve", "--help")
    assert "--max-queue" in proc.stdout and "--memo-mb" in proc.stdout
    proc = run("mlx_streaming", "frobnicate", check_ok=False)
    assert proc.returncode == 2 and "unknown command" in proc.stderr


def test_missing_model(tmp_path):
    proc = run("mlx_streaming.generate", "--model", str(tmp_path / "nope"), check_ok=False)
    assert_one_line_error(proc, "does not exist")


def test_convert_non_moe_and_missing(tmp_path):
    proc = run("mlx_streaming.convert", "--model", str(tmp_path / "nope"), "--out",
               str(tmp_path / "o"), check_ok=False)
    assert_one_line_error(proc, "not a local directory")


def test_budget_too_small_names_the_minimum(qwen):
    proc = run("mlx_streaming.generate", "--model", str(qwen[1]), "--cache-gb", "0.000001",
               check_ok=False)
    assert_one_line_error(proc, r"minimum of 4 per layer.*: use --cache-gb \d")


def test_unknown_version(stream_copy):
    from mlx_streaming.format import manifest_path

    d = json.loads(manifest_path(stream_copy).read_text())
    d["version"] = 7
    manifest_path(stream_copy).write_text(json.dumps(d))
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), check_ok=False)
    assert_one_line_error(proc, "format version 7")


def test_corrupt_and_truncated_blobs(stream_copy):
    spec = read_manifest(stream_copy).layers[0]
    blob = stream_copy / "experts" / spec.file
    data = bytearray(blob.read_bytes())
    for e in range(spec.num_experts):
        data[e * spec.stride + 5] ^= 0xFF
    blob.write_bytes(bytes(data))
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), "--slots-per-layer", "4",
               "--max-tokens", "3", check_ok=False)
    assert_one_line_error(proc, rf"layer {spec.layer}, expert \d+: checksum mismatch")
    proc = run("mlx_streaming.check", str(stream_copy), check_ok=False)
    assert_one_line_error(proc, f"{spec.num_experts} damaged expert records")
    blob.write_bytes(bytes(data[: spec.stride * 3]))
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), check_ok=False)
    assert_one_line_error(proc, rf"layer {spec.layer}, expert 3: blob .* truncated")


def test_read_error_is_one_line(stream_copy):
    """The blob vanishes after loading (a disk pulled out, say)."""
    script = f"""
import mlx.core as mx, os, sys
import mlx_streaming
from mlx_streaming.cli import run_main
from mlx_streaming.format import read_manifest
model, _ = mlx_streaming.load({str(stream_copy)!r}, slots_per_layer=4)
spec = read_manifest({str(stream_copy)!r}).layers[0]
os.truncate(os.path.join({str(stream_copy)!r}, "experts", spec.file), 0)
sys.exit(run_main(lambda: mx.eval(model(mx.array([[1, 2, 3]])))))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert_one_line_error(proc, "short read of .*layer000.blob at offset")


def test_demo_recites_the_zen_of_python(demo_build):
    """The demo's output must read as working, not as noise: its model,
    trained as the demo trains it, recites the passage it learned. (Its
    first run is started with the session: tests/conftest.py.)"""
    proc, cache_dir = demo_build
    assert proc.returncode == 0, proc.stderr
    assert "recite the Zen of Python" in proc.stderr
    assert proc.stdout.startswith("Beautiful is better than ugly.\nExplicit is better than "
                                  "implicit.\nSimple is better than complex."), proc.stdout
    # The second run reuses the cached model and says again what it is.
    proc = run("mlx_streaming.demo", "--cache-dir", str(cache_dir), "--max-tokens", "4")
    assert "[demo] built in" not in proc.stderr and "knows nothing else" in proc.stderr


def test_demo_builds_and_generates_offline(tmp_path):
    proc = run("mlx_streaming.demo", "--cache-dir", str(tmp_path / "demo"), "--train-steps",
               "2", "--max-tokens", "8")
    assert "[demo] built in" in proc.stderr
    assert "decode: 8 tokens" in proc.stderr
    assert "8/16 slots per layer" in proc.stderr
    # The second run reuses the cached model.
    proc = run("mlx_streaming.demo", "--cache-dir", str(tmp_path / "demo"), "--max-tokens", "4")
    assert "[demo] built in" not in proc.stderr


def test_generate_reads_the_prompt_from_stdin_with_a_dash(qwen):
    args = ["--model", str(qwen[1]), "--max-tokens", "6", "--slots-per-layer", "6"]
    base = [sys.executable, "-m", "mlx_streaming.generate", *args]
    piped = subprocess.run(base + ["--prompt", "-"], input="def f(x):", capture_output=True,
                           text=True, timeout=600)
    direct = run("mlx_streaming.generate", *args, "--prompt", "def f(x):")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == direct.stdout and piped.stdout.strip()
    bad = subprocess.run(base + ["--prompt", "-"], input=b"abc\xff", capture_output=True,
                         timeout=600)
    assert_one_line_error(subprocess.CompletedProcess(bad.args, bad.returncode,
                                                      bad.stdout.decode(), bad.stderr.decode()),
                          "not valid UTF-8")


def test_the_command_lists_every_subcommand():
    from mlx_streaming.bench.__main__ import SUBCOMMANDS
    from mlx_streaming.cli import COMMANDS

    proc = run("mlx_streaming", "--help")
    assert proc.stderr == ""  # asked-for help is output, as argparse's is
    for name in COMMANDS:
        assert f"mlx_streaming {name}" in proc.stdout
    listed = proc.stdout.split("mlx_streaming bench")[1].split("}")[0]
    assert sorted(listed.strip(" {").split(",")) == sorted(SUBCOMMANDS)


def test_every_command_prints_its_help():
    # A "%" in an option's help (--routing-max-ppl's "1%") made argparse's
    # help formatting raise in generate and the server.
    from mlx_streaming.bench.__main__ import SUBCOMMANDS
    from mlx_streaming.cli import COMMANDS

    for argv in [[name, "--help"] for name in COMMANDS] + \
            [["bench", name, "--help"] for name in SUBCOMMANDS]:
        proc = run("mlx_streaming", *argv, check_ok=False)
        assert proc.returncode == 0 and "usage:" in proc.stdout, (argv, proc.stderr[-500:])


def test_the_command_without_a_command_is_an_error():
    """It printed the help and exited 0, as if it had done something."""
    proc = subprocess.run([sys.executable, "-m", "mlx_streaming"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "give a command" in proc.stderr
    assert run("mlx_streaming", "--help").returncode == 0


def test_warnings_are_one_line(models, tmp_path):
    """Python's format shows the file, line and source line that warned."""
    src, _ = models.get("qwen3_moe", quantized=False)
    (tmp_path / "a").mkdir()
    proc = subprocess.run([sys.executable, "-m", "mlx_streaming.convert", "--model", str(src),
                           "--out", str(tmp_path / "a" / "b"), "--no-progress", "--dtype",
                           "float16"], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if "Warning" in line or "warning:" in line]
    assert lines and all(line.startswith("warning: ") and ".py:" not in line for line in lines), \
        proc.stderr


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    import mlx_streaming

    for command in (["mlx_streaming", "--version"], ["mlx_streaming", "-V"]):
        assert run(*command).stdout.strip() == f"mlx_streaming {mlx_streaming.__version__}"
    # pyproject takes the version from the package: one place.
    assert version("mlx_streaming") == mlx_streaming.__version__

