"""Shared fixtures: a tokenizer trained once per session, and tiny models of
each family saved in mlx-lm format and converted to stream directories."""

import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import ModelFactory

# A shell that starts the tests in the background (`.ci/run &`) ignores
# SIGINT for them, and the process and every child would inherit that: the
# tests of Ctrl-C would see nothing. Take interrupts as Python does by
# default; children then start with the default too.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The demo's model trains for two to three minutes on one core (as the
# README's first command does): its build starts as the session does, in a
# process of its own on the other core, and the test that reads its output
# runs last.
DEMO_TESTS = ("test_demo_recites_the_zen_of_python",)


class DemoBuild:
    """``python -m mlx_streaming.demo`` run once, in the background."""

    proc = None
    cache_dir = None

    @classmethod
    def start(cls):
        cls.cache_dir = Path(tempfile.mkdtemp(prefix="mlx-streaming-demo-"))
        cls.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_streaming.demo", "--cache-dir", str(cls.cache_dir),
             "--max-tokens", "40"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @classmethod
    def result(cls) -> subprocess.CompletedProcess:
        out, err = cls.proc.communicate(timeout=1200)
        return subprocess.CompletedProcess(cls.proc.args, cls.proc.returncode, out, err)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.name in DEMO_TESTS)  # stable: the rest keep their order


def pytest_collection_finish(session):
    if any(item.name in DEMO_TESTS for item in session.items):
        DemoBuild.start()


def pytest_sessionfinish(session):
    if DemoBuild.proc is not None:
        if DemoBuild.proc.poll() is None:
            DemoBuild.proc.kill()
            DemoBuild.proc.communicate()
        shutil.rmtree(DemoBuild.cache_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def close_what_the_test_left_open():
    """A model a test loaded and did not close (it failed, or it ends with
    the model) is closed after it: its reader threads and files never
    outlive the test."""
    from mlx_streaming.runtime.runtime import OPEN

    before = set(OPEN)
    yield
    for runtime in set(OPEN) - before:
        runtime.close()


@pytest.fixture(scope="session")
def demo_build():
    """``(the demo's first run, its cache directory)``."""
    return DemoBuild.result(), DemoBuild.cache_dir


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from mlx_streaming.testing import tiny

    return tiny.train_tokenizer(tmp_path_factory.mktemp("tokenizer"), 512, 200_000)


@pytest.fixture(scope="session")
def models(tmp_path_factory, tokenizer_dir) -> ModelFactory:
    return ModelFactory(tmp_path_factory.mktemp("models"), tokenizer_dir)


@pytest.fixture
def qwen(models):
    """A 4-bit qwen3_moe: (mlx-lm source dir, stream dir)."""
    return models.get("qwen3_moe", quantized=True)


@pytest.fixture
def stream_copy(tmp_path, qwen):
    """A private copy of the qwen stream directory that a test may damage."""
    dst = tmp_path / "stream"
    shutil.copytree(qwen[1], dst)
    return dst
