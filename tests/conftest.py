"""Shared fixtures: a tokenizer trained once per session, and tiny models of
each family saved in mlx-lm format and converted to stream directories."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from mlx_streaming.testing.helpers import ModelFactory

# A shell that starts the tests in the background (`.ci/run &`) ignores
# SIGINT for them, and the process and every child would inherit that: the
# tests of Ctrl-C would see nothing. Take interrupts as Python does by
# default; children then start with the default too.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The demo's model trains for two to three minutes on one core (as the
# README's first command does): its build starts as the session does, in a
# process of its own, and the test that reads its output runs last. With
# pytest-xdist the first worker starts it and the worker given the test waits.
DEMO_TESTS = ("test_demo_recites_the_zen_of_python",)
DEMO_ARGS = [sys.executable, "-m", "mlx_streaming.demo", "--max-tokens", "40"]


class DemoBuild:
    """``python -m mlx_streaming.demo`` run once per test run, in the
    background; its output and status land in a folder of the run."""

    proc = None
    waiter = None

    @staticmethod
    def folder() -> Path:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
        return Path(tempfile.gettempdir()) / f"mlx-streaming-demo-{run}"

    @classmethod
    def start(cls):
        folder = cls.folder()
        folder.mkdir()
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
            cls.proc = subprocess.Popen(DEMO_ARGS + ["--cache-dir", str(folder / "cache")],
                                        stdout=out, stderr=err)

        def record_status():
            (folder / "rc.tmp").write_text(str(cls.proc.wait()))
            (folder / "rc.tmp").rename(folder / "rc")

        cls.waiter = threading.Thread(target=record_status, daemon=True)
        cls.waiter.start()

    @classmethod
    def result(cls) -> subprocess.CompletedProcess:
        folder = cls.folder()
        deadline = time.monotonic() + 1200
        while not (folder / "rc").exists():
            assert time.monotonic() < deadline, "the demo's build took over 20 minutes"
            time.sleep(0.5)
        return subprocess.CompletedProcess(DEMO_ARGS, int((folder / "rc").read_text()),
                                           (folder / "stdout").read_text(),
                                           (folder / "stderr").read_text())


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.name in DEMO_TESTS)  # stable: the rest keep their order


def pytest_collection_finish(session):
    first_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    if first_worker and any(item.name in DEMO_TESTS for item in session.items):
        DemoBuild.start()


def pytest_sessionfinish(session, exitstatus):
    # Another worker may still be waiting for the build: stop it only on an interrupt.
    if DemoBuild.proc is not None:
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            DemoBuild.proc.kill()
        DemoBuild.waiter.join(timeout=1200)


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
    yield DemoBuild.result(), DemoBuild.folder() / "cache"
    shutil.rmtree(DemoBuild.folder(), ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    from mlx_streaming.testing import tiny

    return tiny.train_tokenizer(tmp_path_factory.mktemp("tokenizer"), 512, 200_000)


@pytest.fixture(scope="session")
def models(tmp_path_factory, tokenizer_dir) -> ModelFactory:
    """Tiny models built once per run: under pytest-xdist in the run's own
    temporary folder, which the workers' folders sit in, shared by them."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return ModelFactory(base / "models-shared", tokenizer_dir)


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
