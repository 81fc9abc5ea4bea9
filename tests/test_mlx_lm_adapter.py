"""mlx_streaming/mlx_lm_adapter.py against the installed mlx-lm: each private
name it relies on still exists and takes what the adapter passes, with a
message naming the change; no other module touches one; and the supported
mlx-lm range is checked at import. scripts/check_mlx_lm_range.py runs these
against the oldest and the newest mlx-lm of the range."""

import ast
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import mlx_lm
import mlx_lm.server as mlx_server
import pytest

import mlx_streaming
from mlx_streaming import mlx_lm_adapter as adapter

PACKAGE = Path(mlx_streaming.__file__).parent
CHANGED = (f"mlx-lm {mlx_lm.__version__} changed mlx_lm.server.{{}}, which "
           "mlx_streaming/mlx_lm_adapter.py relies on: adapt it, or install an mlx-lm "
           "of the range pyproject.toml states")


@pytest.mark.parametrize("name", sorted(adapter.REQUIRED))
def test_each_private_name_exists_with_its_parameters(name):
    found = adapter.parameters(name)
    assert found is not None, CHANGED.format(name) + " (it is gone)"
    assert found == adapter.REQUIRED[name], \
        CHANGED.format(name) + f" (parameters {found}, expected {adapter.REQUIRED[name]})"


def test_the_generation_thread_runs_the_hooked_loop():
    """The adapter keeps the thread alive through ``_run_generate``: mlx-lm
    must start its thread there."""
    source = inspect.getsource(mlx_server.ResponseGenerator.__init__)
    assert "target=self._run_generate" in source, CHANGED.format("ResponseGenerator.__init__")


def test_serving_one_request_calls_stream_generate_by_its_global_name():
    single = mlx_server.ResponseGenerator._serve_single
    assert "stream_generate" in single.__code__.co_names, \
        CHANGED.format("ResponseGenerator._serve_single") + " (no global stream_generate)"
    assert "stream_generate" in vars(mlx_server), CHANGED.format("stream_generate")


def test_a_generators_stream_generate_leaves_mlx_lms_module_alone():
    def replacement():
        return "ours"

    copy = adapter._calling(mlx_server.ResponseGenerator._serve_single, "stream_generate",
                            replacement)
    assert copy.__globals__["stream_generate"] is replacement
    assert mlx_server.stream_generate is mlx_lm.stream_generate
    assert copy.__code__ is mlx_server.ResponseGenerator._serve_single.__code__


def test_the_server_parser_is_mlx_lms_own():
    parser = adapter.server_parser()
    dests = {a.dest for a in parser._actions}
    for name in ("model", "host", "port", "decode_concurrency", "prompt_cache_size",
                 "kv_bits", "kv_group_size", "pipeline", "trust_remote_code"):
        assert name in dests, CHANGED.format(f"main (no --{name.replace('_', '-')} flag)")


def test_the_provider_hooks_reach_mlx_lms_maps():
    class Provider(adapter.ModelProvider):
        def load_model(self, model_path, adapter_path, draft_model_path):
            self.model_key = (model_path, adapter_path, draft_model_path)
            self.model, self.tokenizer = "model", "tokenizer"

    args = adapter.server_parser().parse_args(["--model", "/models/m",
                                               "--chat-template", "T"])
    provider = Provider(args)
    assert provider.tokenizer_config["chat_template"] == "T"
    provider.alias("m", "/models/m")
    assert provider.load("m") == ("model", "tokenizer")
    assert provider.model_key == ("/models/m", None, None)


def test_the_model_class_lookup():
    model_class, args_class = adapter.model_classes({"model_type": "mistral"})
    assert model_class.__module__ == "mlx_lm.models.llama"  # mlx-lm's remapping
    assert args_class.__name__ == "ModelArgs"


def _private_mlx_lm_uses(path: Path):
    """Lines of ``path`` that import a private mlx-lm name, or reach one
    through a module alias of mlx-lm."""
    tree = ast.parse(path.read_text())
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith("mlx_lm")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm"):
            for a in node.names:
                if a.name.startswith("_"):
                    yield node.lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and ast.unparse(node.value) in aliases:
            yield node.lineno


def test_no_other_module_touches_a_private_mlx_lm_name():
    found = [f"{p.relative_to(PACKAGE)}:{line}" for p in sorted(PACKAGE.rglob("*.py"))
             if p.name != "mlx_lm_adapter.py" for line in _private_mlx_lm_uses(p)]
    assert not found, "private mlx-lm names outside the adapter: " + ", ".join(found)


def test_subclasses_override_hooks_not_mlx_lms_private_methods():
    bases = {adapter.ModelProvider: mlx_server.ModelProvider,
             adapter.ResponseGenerator: mlx_server.ResponseGenerator,
             adapter.APIHandler: mlx_server.APIHandler}
    import mlx_streaming.server as server

    overrides = []
    for info in pkgutil.iter_modules(server.__path__, "mlx_streaming.server."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            for ours, theirs in bases.items():
                if isinstance(cls, type) and issubclass(cls, ours) and cls is not ours:
                    overrides += [f"{cls.__name__}.{name}" for name in vars(cls)
                                  if name.startswith("_") and not name.startswith("__")
                                  and hasattr(theirs, name)]
    assert not overrides, f"override the adapter's hooks instead: {overrides}"


def test_an_mlx_lm_outside_the_range_is_one_line_at_import(tmp_path):
    import re

    from mlx_streaming.supported import check_mlx_lm, mlx_lm_range

    supported = mlx_lm_range()  # from the installed metadata: pyproject's
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert re.search(r'"mlx-lm([^"]+)"', pyproject).group(1) == supported
    check_mlx_lm()  # the installed one
    # A dist-info found first on the path stands for an old install.
    info = tmp_path / "mlx_lm-0.31.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mlx-lm\nVersion: 0.31.0\n")
    proc = subprocess.run([sys.executable, "-c", "import mlx_streaming"], capture_output=True,
                          text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin"},
                          timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: mlx_streaming ") and "not the installed 0.31.0" in last
    assert f"pip install 'mlx-lm{supported}'" in last
