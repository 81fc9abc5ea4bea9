"""``python -m mlx_streaming.convert``: the command line of ``convert``.

    python -m mlx_streaming.convert --model SRC --out DST [-q --q-bits 4 --q-group-size 64]
        [--miss-bits 3] [--upload ORG/NAME]
    python -m mlx_streaming.convert --out DST --miss-bits 3     (add copies to DST)
"""

import argparse
import sys
import urllib.parse
from pathlib import Path
from typing import Optional

from ..errors import ConversionError, first_line
from ..flags import Parser
from ..format import (
    CONVERT_STATE_NAME,
    manifest_path,
)
from .copies import write_copies
from .local import DTYPES, QUANTIZATION, convert, quantization_defaults


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="mlx_streaming convert",
        description="Convert an mlx-lm MoE model into a stream directory.",
    )
    p.add_argument("--model", default=None, help="local mlx-lm model dir or HF repo id "
                   "(not needed to add --miss-bits copies to a converted --out)")
    p.add_argument("--out", required=True, help="stream directory to write")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize while converting")
    p.add_argument("--q-bits", type=int, default=None,
                   help="with -q: bits per weight (default: 4; 8 for mxfp8)")
    p.add_argument("--q-group-size", type=int, default=None,
                   help="with -q: weights per scale (default: 64; 32 for mxfp4 and mxfp8, "
                        "16 for nvfp4)")
    p.add_argument("--q-mode", default=None, choices=list(QUANTIZATION),
                   help="with -q: affine (default), mxfp4, nvfp4 or mxfp8")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="cast floating weights before quantizing (float32 scales "
                        "are fastest on MLX's CPU backend)")
    p.add_argument("--force", action="store_true",
                   help="overwrite another converted model; without --model, write the "
                        "--miss-bits copies again though --out holds them")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split every expert into N ranks' slices, each rank's in files of "
                        "its own (for --tensor-parallel runs on N machines)")
    p.add_argument("--miss-bits", type=_widths, default=(), metavar="BITS[,BITS]",
                   help="also write low-bit copies of every expert at these widths (2, 3, "
                        "...), which --miss-bits runs read on a miss (approximate); without "
                        "--model, added to the converted --out (--force: written anew)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--upload", default=None, metavar="ORG/REPO",
                   help="then publish the stream directory to this Hub model repo, which "
                        "`mlx_streaming.load('ORG/REPO')` streams by HTTP range")
    p.add_argument("--private", action="store_true", help="create the --upload repo private")
    p.add_argument("--endpoint", default=None,
                   help="the Hub's URL for --upload (default: huggingface_hub's, HF_ENDPOINT)")
    return p


def _widths(text: str):
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"widths are integers like 2 or 2,3; got {text!r}")


def check_endpoint(endpoint: Optional[str]) -> None:
    """Refuse an ``--endpoint`` that is not an HTTP(S) URL before converting."""
    if endpoint is None:
        return
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConversionError(f"--endpoint {endpoint!r} is not an http(s) URL, like "
                              "https://huggingface.co")


def check_repo_id(repo_id: str) -> None:
    """Refuse an ``--upload`` id the Hub cannot take before converting."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ConversionError(f"--upload {repo_id!r} is not a repo id ({first_line(e)}); "
                              "give ORG/NAME") from None
    if "/" not in repo_id:
        raise ConversionError(f"--upload {repo_id!r} names no owner; give ORG/NAME")


def upload(out: Path, repo_id: str, endpoint: Optional[str] = None,
           private: bool = False) -> str:
    """Publish the stream directory ``out`` to the Hub model repo ``repo_id``
    (created if needed) in one commit. Returns the commit URL."""
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    if not manifest_path(out).is_file():
        raise ConversionError(f"{out} is not a complete stream directory; convert it first")
    api = HfApi(endpoint=endpoint)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=str(out),
                                 commit_message="Upload mlx_streaming stream directory",
                                 ignore_patterns=[CONVERT_STATE_NAME, "*.tmp*"])
    except Exception as e:
        raise ConversionError(f"cannot upload {out} to {repo_id} ({type(e).__name__}: "
                              f"{first_line(e)}); {_upload_hint(e, api)}") from None
    return str(info)


def _upload_hint(error: Exception, api) -> str:
    """What to do about a failed upload, by what failed."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status in (401, 403):
        return "log in with `hf auth login` or set HF_TOKEN, with write access to the repo"
    if status is None and any(w in type(error).__name__ for w in ("Connect", "Timeout")):
        return (f"the Hub at {api.endpoint} cannot be reached; check the network or "
                "--endpoint, then upload again (the conversion is done: it is not redone)")
    return "check the repo id and your access to it, then run the same command again"


def main(argv=None) -> int:
    from ..cli import run_main

    def body():
        args = setup_arg_parser().parse_args(argv)
        if args.model is None:
            if not args.miss_bits:
                raise ConversionError("--model is needed (only adding --miss-bits copies to a "
                                      "converted --out goes without it)")
            written = write_copies(Path(args.out).expanduser(), args.miss_bits,
                                   not args.no_progress, force=args.force)
            if written:
                print(f"wrote the {','.join(map(str, written))}-bit copies of {args.out}",
                      file=sys.stderr)
            return
        given = [f for f in ("q_bits", "q_group_size", "q_mode") if getattr(args, f) is not None]
        if given and not args.quantize:
            raise ConversionError(f"--{given[0].replace('_', '-')} is a quantization setting: "
                                  "add -q to quantize")
        if args.upload is None and (args.endpoint is not None or args.private):
            raise ConversionError("--endpoint and --private are settings of --upload: add "
                                  "--upload ORG/NAME")
        mode = args.q_mode or "affine"
        bits, group = quantization_defaults(mode)
        if args.upload is not None:
            check_repo_id(args.upload)  # before hours of converting
            check_endpoint(args.endpoint)
        out = convert(
            args.model,
            args.out,
            quantize=args.quantize,
            q_bits=args.q_bits if args.q_bits is not None else bits,
            q_group_size=args.q_group_size if args.q_group_size is not None else group,
            q_mode=mode,
            dtype=args.dtype,
            force=args.force,
            progress=not args.no_progress,
            tensor_parallel=args.tensor_parallel,
            miss_bits=args.miss_bits,
        )
        print(f"wrote {out}", file=sys.stderr)
        if args.upload is not None:
            url = upload(Path(out), args.upload, args.endpoint, args.private)
            print(f"uploaded to {args.upload}: {url}", file=sys.stderr)

    return run_main(body)
