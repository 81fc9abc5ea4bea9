"""Builds the native extension (native/, CMake + nanobind) into
mlx_streaming/_ext. Everything else is declared in pyproject.toml.

A failed native build does not fail the install: the package then runs on
its Python reader and says so loudly, at install and at every load. Set
MLX_STREAMING_REQUIRE_NATIVE=1 (CI does) to make a failed build an error."""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
NANOBIND_SERIES = "3.0."


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: Path):
        # optional: an editable install copies the built library into the
        # source tree, which must not fail when the build was skipped.
        super().__init__(name, sources=[], optional=True)
        self.sourcedir = str(sourcedir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        # Build-time switches only; the package itself reads no environment.
        if os.environ.get("MLX_STREAMING_NO_NATIVE") == "1":
            print("MLX_STREAMING_NO_NATIVE=1: skipping the native extension")
            return
        try:
            self._build(ext)
        except Exception as e:
            if os.environ.get("MLX_STREAMING_REQUIRE_NATIVE") == "1":
                raise
            # The Metal branch of native/ is compiled only on a Mac: a failure
            # there must still leave a working (slower) install.
            warn_native_failed(e)

    def _build(self, ext: CMakeExtension) -> None:
        self._check_nanobind()
        extdir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if _has_ninja():
            args += ["-G", "Ninja"]
        subprocess.run(["cmake", ext.sourcedir, *args], cwd=build_temp, check=True)
        jobs = str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_temp, check=True)

    @staticmethod
    def _check_nanobind() -> None:
        import nanobind

        if not nanobind.__version__.startswith(NANOBIND_SERIES):
            raise RuntimeError(
                f"nanobind {nanobind.__version__} found, but mlx 0.32 was built "
                f"with nanobind {NANOBIND_SERIES}x: an extension built with "
                "another version compiles but fails when called. Install "
                f"nanobind=={NANOBIND_SERIES}* in the build environment."
            )


def warn_native_failed(error: Exception) -> None:
    bar = "!" * 78
    print(
        f"\n{bar}\nWARNING: mlx_streaming's native extension failed to build:\n"
        f"  {type(error).__name__}: {error}\n"
        "mlx_streaming is installed WITHOUT it and reads experts with its Python\n"
        "reader (slower, no paged calls inside the graph). Install a C++ compiler and CMake,\n"
        "then `pip install -e .` again; MLX_STREAMING_REQUIRE_NATIVE=1 makes this\n"
        f"an error.\n{bar}\n",
        file=sys.stderr,
    )


def _has_ninja() -> bool:
    try:
        subprocess.run(["ninja", "--version"], capture_output=True, check=True)
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import it
    setup(
        ext_modules=[CMakeExtension("mlx_streaming._ext", ROOT / "native")],
        cmdclass={"build_ext": CMakeBuild},
    )
