"""Check every expert record and spine file of a stream directory against
its checksum.

    python -m mlx_streaming.check DIR
"""

import sys
from pathlib import Path

from .cli import run_main
from .errors import FormatError
from .flags import Parser


def main(argv=None) -> int:
    p = Parser(prog="mlx_streaming check", description=__doc__)
    p.add_argument("model", help="stream directory")

    def body():
        args = p.parse_args(argv)
        args.model = str(Path(args.model).expanduser())
        from tqdm import tqdm

        from .format import damaged_records, damaged_spine, read_manifest

        manifest = read_manifest(args.model)
        spine = damaged_spine(args.model, manifest)
        if spine:
            raise FormatError(
                f"{len(spine)} damaged or missing spine files ({', '.join(spine)}); "
                "re-convert the model"
            )
        total = sum(l.num_experts for l in manifest.expert_layers())
        with tqdm(total=total, unit="expert", file=sys.stderr,
                  disable=not sys.stderr.isatty()) as bar:
            bad = damaged_records(args.model, progress=bar.update)
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
        print(f"{args.model}: {spine_note}all {total} expert records match their checksums")

    return run_main(body)


if __name__ == "__main__":
    from .cli import leave

    leave(main())
