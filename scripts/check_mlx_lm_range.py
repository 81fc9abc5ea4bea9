"""Run the mlx-lm adapter's tests and a few server tests against the oldest
and the newest mlx-lm release of the range pyproject.toml states, each
installed beside the venv's (``pip install --target``), not over it; the
venv's own release is left to the test suite.

    python scripts/check_mlx_lm_range.py [--versions 0.32.1,0.32.2]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from mlx_streaming.supported import in_range, mlx_lm_range, release

ROOT = Path(__file__).resolve().parents[1]
# The adapter's own checks, and server runs through each hook: a plain
# request, batching, a failure mid-generation, drafting, the flags.
TESTS = ["tests/test_mlx_lm_adapter.py",
         "tests/server/test_server.py::test_chat_and_completions_stream_and_not",
         "tests/server/test_server.py::test_read_error_mid_generation_is_a_500_not_a_traceback",
         "tests/server/test_server.py::test_the_servers_flags_are_mlx_lms",
         "tests/server/test_server.py::test_the_server_drafts_losslessly",
         "tests/server/test_server.py::test_requests_together_are_decoded_together_as_mlx_lm_does"]


def released_versions() -> list:
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "mlx-lm",
                          "--json"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)["versions"]


def ends_of_range() -> list:
    supported = mlx_lm_range()
    inside = sorted((v for v in released_versions() if in_range(v, supported)), key=release)
    if not inside:
        sys.exit(f"no released mlx-lm in {supported}")
    return sorted({inside[0], inside[-1]}, key=release)


def check(version: str) -> bool:
    with tempfile.TemporaryDirectory(prefix=f"mlx-lm-{version}-") as target:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", target, f"mlx-lm=={version}"], check=True)
        env = dict(os.environ, PYTHONPATH=target)
        found = subprocess.run([sys.executable, "-c", "import mlx_lm; print(mlx_lm.__version__)"],
                               env=env, capture_output=True, text=True, check=True).stdout
        assert found.strip() == version, f"mlx-lm {found.strip()} imported, not {version}"
        print(f"mlx-lm {version}:", flush=True)
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *TESTS], cwd=ROOT, env=env).returncode == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", help="comma-separated mlx-lm versions (default: the "
                   "oldest and newest release of the supported range)")
    args = p.parse_args()
    versions = args.versions.split(",") if args.versions else ends_of_range()
    installed = metadata.version("mlx-lm")
    if not args.versions and installed in versions:
        # The whole test suite runs against the venv's own mlx-lm.
        print(f"mlx-lm {installed}: the venv's own, which the test suite runs against")
        versions.remove(installed)
    failed = [v for v in versions if not check(v)]
    if failed:
        print(f"mlx-lm {', '.join(failed)}: the adapter's tests failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
