"""Run by .ci/run from outside the checkout, in a venv holding only the
built wheel: every module imports, the native extension loaded, and
`generate` and a server request work on a tiny model built here."""

import importlib
import json
import pkgutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def import_every_module() -> int:
    import mlx_streaming

    assert "site-packages" in mlx_streaming.__file__, mlx_streaming.__file__
    # A __main__ module is a command: importing it runs it (convert.py is
    # one too, and refuses to be imported).
    names = [m.name for m in pkgutil.walk_packages(mlx_streaming.__path__, "mlx_streaming.")
             if not m.name.endswith(".__main__") and m.name != "mlx_streaming.convert"]
    for name in names:
        importlib.import_module(name)
    return len(names)


def tiny_stream(root: Path) -> Path:
    from mlx_streaming.conversion.local import convert
    from mlx_streaming.testing import tiny

    tokenizer = tiny.train_tokenizer(root / "tokenizer", 512, 100_000)
    config = tiny.tiny_config("qwen3_moe", 512)
    tiny.save_mlx_model(tiny.build_model(config), config, root / "mlx", tokenizer)
    convert(root / "mlx", root / "stream")
    return root / "stream"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_one_request(stream: Path) -> str:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlx_streaming.server", "--model",
                               str(stream), "--port", str(port), "--slots-per-layer", "4"],
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    data=json.dumps({"messages": [{"role": "user", "content": "def"}],
                                     "max_tokens": 8}).encode(),
                    headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=120) as r:
                    return json.load(r)["choices"][0]["message"]["content"]
            except OSError:
                assert server.poll() is None, server.stderr.read()
                assert time.monotonic() < deadline, "the server did not answer in 300 s"
                time.sleep(1)
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    print(f"wheel: imported {import_every_module()} modules")
    from mlx_streaming.io.native import load_extension

    ext, why = load_extension()
    assert ext is not None, why
    print("wheel: native extension:", why)
    with tempfile.TemporaryDirectory() as tmp:
        stream = tiny_stream(Path(tmp))
        out = subprocess.run([sys.executable, "-m", "mlx_streaming", "generate", "--model",
                              str(stream), "--prompt", "def", "--max-tokens", "8",
                              "--slots-per-layer", "4"], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0 and "decode: 8 tokens" in out.stderr, out.stderr
        print("wheel: generate ran")
        print(f"wheel: the server answered {serve_one_request(stream)!r}")


if __name__ == "__main__":
    main()
