"""Shared fixtures: a tokenizer trained once per session, and tiny models of
each family saved in mlx-lm format and converted to stream directories."""

import shutil
import signal
from pathlib import Path

import pytest

from helpers import ModelFactory

# A shell that starts the tests in the background (`.ci/run &`) ignores
# SIGINT for them, and the process and every child would inherit that: the
# tests of Ctrl-C would see nothing. Take interrupts as Python does by
# default; children then start with the default too.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
