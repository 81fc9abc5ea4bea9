"""Options, flags, paths and names: every bad value is a one-line error that
says what to do; load() takes mlx-lm's arguments; Ctrl-C is one line."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlx_streaming
from mlx_streaming.config import StreamConfig
from mlx_streaming.conversion.local import convert
from mlx_streaming.errors import (
    ConfigError,
    ConversionError,
    FormatError,
)
from mlx_streaming.format import manifest_path, read_manifest
from mlx_streaming.testing.helpers import assert_one_line_error, run


@pytest.mark.parametrize("flags, message", [
    (["--cache-gb", "0"], "cache_gb must be above 0"),
    (["--cache-gb", "-1"], "cache_gb must be above 0"),
    (["--cache-gb", "nan"], "cache_gb must be a finite number"),
    (["--cache-gb", "inf"], "cache_gb must be a finite number"),
    (["--slots-per-layer", "0"], "slots_per_layer must be between 1 and"),
    (["--slots-per-layer", "-3"], "slots_per_layer must be between 1 and"),
    (["--io-threads", "0"], "io_threads must be between 1 and 64"),
    (["--io-threads", "100000"], "io_threads must be between 1 and 64"),
    (["--prefetch-records", "-1"], "prefetch_records must be between 0 and 65536"),
    (["--max-tokens", "-5"], "--max-tokens: must be an integer from 1"),
    (["--max-tokens", "0"], "--max-tokens: must be an integer from 1"),
    (["--temp", "1e-38"], "--temp: must be 0 \\(greedy\\) or at least 0.001"),
    (["--temp", "-1"], "--temp: must be a finite number at least 0"),
    (["--top-p", "0"], "--top-p: must be a finite number above 0"),
    (["--num-draft-tokens", "0"], "--num-draft-tokens: must be an integer from 1 to 64"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--prompt", ""], "prompt is empty"),
    (["--seed", str(10**30)], "--seed: must be an integer from 0"),
    (["--trace", "/"], "cannot write the trace to /"),
    (["--stats-json", "/", "--max-tokens", "2"], "cannot write --stats-json /"),
    # A directory where nothing can be made (as root, only such a one refuses).
    (["--stats-json", "/proc/s.json"], "cannot write --stats-json /proc/s.json"),
])
def test_bad_flags_are_one_line_errors(qwen, flags, message):
    proc = run("mlx_streaming.generate", "--model", str(qwen[1]), *flags, check_ok=False)
    assert_one_line_error(proc, message)


def test_config_errors_are_value_errors_and_streaming_errors():
    for bad in (dict(cache_gb=float("nan")), dict(io_threads=10**5), dict(checksums="sometimes"),
                dict(policy="mru"), dict(prefetch_records=-1),
                dict(slots_per_layer=2.5), dict(direct_io="yes"), dict(direct_io=1),
                dict(overlap=1), dict(mtp=0), dict(prefetch_affinity="on"),
                dict(read_pace_mbps=0.001), dict(read_pace_mbps=-1.0),
                dict(read_pace_mbps=1e12)):
        with pytest.raises(ConfigError):
            StreamConfig(**bad)
    assert issubclass(ConfigError, ValueError)


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    import numpy as np

    config = StreamConfig(prefetch_precision=np.float32(0.5), slots_per_layer=np.int64(4),
                          cache_gb=2)
    assert (config.prefetch_precision, config.slots_per_layer, config.cache_gb) == (0.5, 4, 2.0)
    assert type(config.prefetch_precision) is float and type(config.slots_per_layer) is int
    for bad in (dict(prefetch_precision=True), dict(prefetch_precision=np.bool_(True)),
                dict(slots_per_layer=np.float64(3)), dict(prefetch_precision=np.float32(1.5)),
                dict(cache_gb=10**400), dict(slots_per_layer=10**400)):  # not OverflowError
        with pytest.raises(ConfigError):
            StreamConfig(**bad)


def test_load_takes_mlx_lm_load_arguments(qwen):
    model, tokenizer, config = mlx_streaming.load(str(qwen[1]), None, None, None, False, True,
                                                  slots_per_layer=4)
    assert config["model_type"] == "qwen3_moe"
    with pytest.raises(ConfigError, match="adapter_path"):
        mlx_streaming.load(qwen[1], adapter_path="adapters")
    with pytest.raises(ConfigError, match="unknown option 'cache_size'"):
        mlx_streaming.load(qwen[1], cache_size=3)


def test_sigint_during_start_up_is_one_line(qwen):
    # An interrupt inside Python's own start-up (its site module) is a fatal
    # error no program can catch; ours begins with the package's import, so
    # each interrupt is sent once it finished (``-X importtime`` says when).
    import signal

    for delay in (0.0, 0.3, 0.8, 1.5):
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "mlx_streaming.generate",
                                 "--model", str(qwen[1]), "--max-tokens", "50"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.rstrip().endswith("| mlx_streaming"):
                break
        else:
            pytest.fail("the package's import never finished:\n" + "".join(lines[-20:]))
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=120)
        err = "".join(line for line in lines + rest.splitlines(True)
                      if not line.startswith("import time:"))
        assert "Traceback" not in err, f"after {delay} s:\n{err}"
        # 130: our handler's exit; -SIGINT: Python re-raising the signal at exit.
        assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)


def test_sigint_inside_a_finalizer_ends_the_command_quietly():
    # CI saw a Ctrl-C land in a garbage-collected ``__del__`` during a
    # command: Python printed it as an ignored exception with a traceback and
    # the command went on. Inside a finalizer it now ends the command.
    import signal

    code = ("import signal, sys, time\n"
            "from mlx_streaming import cli\n"
            "signal.signal(signal.SIGINT, cli._interrupted_while_starting)\n"
            "class Slow:\n"
            "    def __del__(self):\n"
            "        print('finalizing', flush=True); time.sleep(3)\n"
            "def body():\n"
            "    s = Slow(); del s\n"
            "    print('went on', flush=True)\n"
            "sys.exit(cli.run_main(body))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "finalizing\n"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (130, "", "interrupted\n")


@pytest.mark.parametrize("leave", [True, False])
def test_sigint_while_the_interpreter_exits_ends_it_quietly(leave):
    # A Ctrl-C that lands after a command's work, while Python joins its
    # threads at exit, printed a traceback (seen in CI); ``leave`` ends the
    # process without the interpreter's teardown: at once, quietly, with its
    # status.
    # The thread holds the exit open so that the interrupt lands there.
    import signal

    code = ("import sys, threading, time\n"
            "from mlx_streaming.cli import leave\n"
            "threading.Thread(target=time.sleep, args=(1.5,)).start()\n"
            "print('exiting', flush=True)\n"
            + ("leave(0)\n" if leave else "sys.exit(0)\n"))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "exiting\n"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if leave:
        assert (proc.returncode, err) == (0, "")
    else:  # the case ``leave`` exists for: the test can tell them apart
        assert "Traceback" in err and "KeyboardInterrupt" in err


def test_tilde_paths_are_expanded(tmp_path, qwen, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    dst = convert(qwen[0], "~/models/q", progress=False)
    assert Path(dst) == tmp_path / "models" / "q"
    assert not Path("~").exists()
    with mlx_streaming.load("~/models/q", slots_per_layer=4):
        pass
    proc = run("mlx_streaming.check", "~/models/q")
    assert "match their checksums" in proc.stdout


def test_importing_the_convert_module_keeps_convert_callable(tmp_path, qwen):
    """The command's module refuses to be imported (Python would bind it
    over the package's ``convert`` function), and the function works."""
    script = f"""
try:
    import mlx_streaming.convert
except ImportError as e:
    assert "python -m mlx_streaming.convert" in str(e)
else:
    raise SystemExit("imported")
import mlx_streaming
out = mlx_streaming.convert({str(qwen[0])!r}, {str(tmp_path / 's')!r}, progress=False)
print(mlx_streaming.format.read_manifest(out).layers[0].file)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "layer000.blob"


@pytest.mark.parametrize("damage", ["no config", "bad config", "no tokenizer"])
def test_a_stream_directory_missing_its_config_or_tokenizer_is_one_line(stream_copy, damage,
                                                                       monkeypatch):
    if damage == "no config":
        (stream_copy / "config.json").unlink()
    elif damage == "bad config":
        (stream_copy / "config.json").write_text("{garbage")
    else:
        (stream_copy / "tokenizer.json").unlink()
    match = "tokenizer" if damage == "no tokenizer" else "config.json"

    def never(*args):
        raise AssertionError("the runtime was built before the tokenizer was checked")

    with monkeypatch.context() as m:
        m.setattr("mlx_streaming.runtime.loader._build_runtime", never)  # known before the weights
        with pytest.raises(FormatError, match=match):
            mlx_streaming.load(stream_copy, slots_per_layer=4)
    proc = run("mlx_streaming.generate", "--model", str(stream_copy), "--max-tokens", "2",
               check_ok=False)
    assert_one_line_error(proc, match)


def test_a_manifest_entry_naming_another_layers_module_is_refused(stream_copy):
    """Its experts would run in the other layer: wrong output, checksums fine."""
    path = manifest_path(stream_copy)
    manifest = json.loads(path.read_text())
    first, second = manifest["layers"][:2]
    first["module"], second["module"] = second["module"], first["module"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="is not in layer"):
        mlx_streaming.load(stream_copy, slots_per_layer=4)


def test_trace_must_be_a_path_outside_the_model(qwen):
    for bad in (True, "", 5):
        with pytest.raises(ConfigError, match="trace must be a file path"):
            StreamConfig(trace=bad)
    assert StreamConfig(trace="~/t.jsonl").trace == os.path.expanduser("~/t.jsonl")
    blob = qwen[1] / "experts" / read_manifest(qwen[1]).layers[0].file
    before = blob.stat().st_size
    with pytest.raises(ConfigError, match="model's own directory"):
        mlx_streaming.load(qwen[1], trace=str(blob))
    assert blob.stat().st_size == before


def test_load_refuses_arguments_of_the_wrong_kind(qwen):
    with pytest.raises(ConfigError, match="model_config must be a dict"):
        mlx_streaming.load(qwen[1], model_config="x")
    with pytest.raises(ConfigError, match="config must be a StreamConfig"):
        mlx_streaming.load(qwen[1], config={"slots_per_layer": 4})


def test_odd_prompts_and_outputs_are_one_line_or_quiet(qwen, tmp_path):
    stream = str(qwen[1])
    proc = run("mlx_streaming.generate", "--model", stream, "--max-tokens", "2", "--prompt",
               os.fsdecode(b"\xff\xfe abc"), check_ok=False)  # not UTF-8: surrogates
    assert_one_line_error(proc, "not valid UTF-8")
    proc = run("mlx_streaming.generate", "--model", stream, "--max-tokens", "2",
               "--stats-json", str(tmp_path / "missing" / "s.json"), check_ok=False)
    assert_one_line_error(proc, "cannot write --stats-json")
    assert "tok/s" not in proc.stderr  # refused before generating
    # The reader of the output leaves (``| head``): a quiet stop.
    gen = subprocess.Popen([sys.executable, "-m", "mlx_streaming.generate", "--model", stream,
                            "--max-tokens", "50"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    gen.stdout.close()
    err = gen.stderr.read()
    assert gen.wait(300) == 141 and "Traceback" not in err and "Exception" not in err, err


def test_converting_a_stream_directory_or_one_without_a_tokenizer_says_so(qwen, tmp_path,
                                                                           capsys):
    with pytest.raises(ConversionError, match="already a stream directory"):
        convert(qwen[1], tmp_path / "again")
    src = tmp_path / "src"
    shutil.copytree(qwen[0], src)
    for f in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        (src / f).unlink(missing_ok=True)
    convert(src, tmp_path / "out")
    assert "has no tokenizer vocabulary" in capsys.readouterr().err
    (src / "tekken.json").write_text("{}")  # Mistral's: a vocabulary, no warning
    convert(src, tmp_path / "out2")
    assert "tokenizer vocabulary" not in capsys.readouterr().err


def test_only_commands_take_ctrl_c_quietly_while_starting():
    from mlx_streaming.cli import COMMAND_MODULES, COMMANDS

    # Every command's module is one python -m runs.
    assert {f"mlx_streaming.{name}" for name in COMMANDS if name != "serve"} \
        <= COMMAND_MODULES | {"mlx_streaming.bench"}
    code = ("import signal, mlx_streaming.cli as c; "
            "print(signal.getsignal(signal.SIGINT) is c._interrupted_while_starting)")
    library = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
    assert library.stdout.strip() == "False", library.stderr  # an import leaves Ctrl-C alone


def test_bench_flags_named_as_options_are_the_options():
    """A bench flag spelt as an option (or its plural, values to compare)
    is that option's: declared from its StreamConfig field, so its help is
    the field's and its values are checked as load() checks them."""
    import argparse

    from mlx_streaming.bench.__main__ import setup_arg_parser
    from mlx_streaming.config import config_fields, option_help

    # Same spelling, another meaning: a routing trace to read, not to write.
    inputs = {"--trace"}
    names = {}
    for name in config_fields():
        flag = "--" + name.replace("_", "-")
        names.update({flag: name, (flag[:-1] + "ies" if flag.endswith("y") else flag + "s"): name})
    sub = next(a for a in setup_arg_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    checked, by_hand = [], []
    for command, parser in sub.choices.items():
        for action in parser._actions:
            if inputs & set(action.option_strings):
                continue
            options = {names[s] for s in action.option_strings if s in names}
            options |= {action.dest} & set(config_fields())
            for name in options:
                said = " ".join(option_help(name).replace("%", "%%").split())
                where = f"bench {command} {'/'.join(action.option_strings)}"
                in_help = said in " ".join((action.help or "").split())
                (checked if in_help else by_hand).append(where)
    assert not by_hand, f"declared by hand, not from StreamConfig: {by_hand}"
    assert {"bench decode --policies", "bench io --io-threads/--threads",
            "bench speculative --overlap"} <= set(checked)
