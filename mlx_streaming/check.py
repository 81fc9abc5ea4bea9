"""Check every expert record and spine file of a stream directory against
its checksum.

    python -m mlx_streaming.check DIR
"""

import sys
from pathlib import Path

from .cli import run_main
from .errors import FormatError
from .flags import Parser, count

# More tensor-parallel ranks than a conversion takes (conversion.tensor_parallel).
MAX_RANK = 63


def main(argv=None) -> int:
    p = Parser(prog="mlx_streaming check", description=__doc__)
    p.add_argument("model", help="stream directory")
    p.add_argument("--rank", type=count(0, MAX_RANK), default=None,
                   help="of a tensor-parallel conversion: check this rank's records only "
                        "(a machine that holds only its own)")

    def body():
        args = p.parse_args(argv)
        args.model = str(Path(args.model).expanduser())
        from tqdm import tqdm

        from .format import checked_layers, damaged_records, damaged_spine, read_manifest

        manifest = read_manifest(args.model, blobs=False)
        layers = checked_layers(args.model, args.rank)
        spine = damaged_spine(args.model, manifest)
        if spine:
            raise FormatError(
                f"{len(spine)} damaged or missing spine files ({', '.join(spine)}); "
                "re-convert the model"
            )
        total = sum(l.num_experts for l in layers)
        with tqdm(total=total, unit="expert", file=sys.stderr,
                  disable=not sys.stderr.isatty()) as bar:
            bad = damaged_records(args.model, progress=bar.update, rank=args.rank)
        if bad:
            listed = ", ".join(f"layer {l} expert {e}" for l, e in bad[:10])
            more = f" and {len(bad) - 10} more" if len(bad) > 10 else ""
            raise FormatError(
                f"{len(bad)} damaged expert records: {listed}{more}; re-convert the model"
            )
        spine_note = (f"{len(manifest.spine)} spine files and " if manifest.spine else
                      "(this manifest predates spine checksums: spine not checked) ")
        if manifest.dense:
            spine_note += f"{len(manifest.dense)} dense layer records and "
        whose = "" if args.rank is None else f" of rank {args.rank}"
        print(f"{args.model}: {spine_note}all {total} expert records{whose} match their "
              "checksums")

    return run_main(body)


if __name__ == "__main__":
    from .cli import leave

    leave(main())
