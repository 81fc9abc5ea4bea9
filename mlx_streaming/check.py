"""Check every expert record and spine file of a stream directory against
its checksum.

    python -m mlx_streaming.check DIR
"""

import sys
from pathlib import Path
from typing import List

from .cli import run_main
from .errors import CorruptExpertError, FormatError
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

        from .format import (
            checked_dense,
            checked_layers,
            damaged_experts,
            damaged_spine,
            read_manifest,
        )

        manifest = read_manifest(args.model, blobs=False, dense=False)
        try:
            layers = checked_layers(args.model, args.rank)
        except CorruptExpertError as e:
            raise FormatError(e.brief) from None  # its pointer to `check` is this command
        spine = damaged_spine(args.model, manifest, args.rank)
        if spine:
            raise FormatError(
                f"{len(spine)} damaged or missing spine files ({', '.join(spine)}); "
                "re-convert the model"
            )
        total = sum(spec.num_experts for spec in layers)
        with tqdm(total=total, unit="expert", file=sys.stderr,
                  disable=not sys.stderr.isatty()) as bar:
            bad = damaged_experts(args.model, progress=bar.update, rank=args.rank)
        if bad:
            raise FormatError("; ".join(_damage(args.model, bad)))
        records = sum(spec.num_experts for spec in layers if spec.copy_bits is None)
        widths = sorted({spec.copy_bits for spec in layers} - {None})
        copies = (f" and their {','.join(map(str, widths))}-bit copies ({total - records})"
                  if widths else "")
        spine_note = (f"{len(manifest.spine)} spine files and " if manifest.spine else
                      "(this manifest predates spine checksums: spine not checked) ")
        dense = checked_dense(manifest, args.rank)
        if dense:
            spine_note += f"{len(dense)} dense layer records and "
        whose = "" if args.rank is None else f" of rank {args.rank}"
        print(f"{args.model}: {spine_note}all {records} expert records{whose}{copies} match "
              "their checksums")

    return run_main(body)


def _damage(path: str, bad) -> List[str]:
    """What ``check`` says of the damaged records ``bad`` (``(layer entry,
    expert)``): the records themselves, then each width's low-bit copies,
    each with what to do about them."""
    from .format import write_copies_command

    def listed(pairs):
        names = ", ".join(f"layer {s.layer} expert {e}" for s, e in pairs[:10])
        return names + (f" and {len(pairs) - 10} more" if len(pairs) > 10 else "")

    out = []
    records = [(s, e) for s, e in bad if s.copy_bits is None]
    if records:
        out.append(f"{len(records)} damaged expert records: {listed(records)}; "
                   "re-convert the model")
    for bits in sorted({s.copy_bits for s, _ in bad} - {None}):
        copies = [(s, e) for s, e in bad if s.copy_bits == bits]
        out.append(f"{len(copies)} damaged {bits}-bit copies of expert records (convert "
                   f"--miss-bits): {listed(copies)}; write them again with "
                   f"{write_copies_command(path, bits, force=True)}")
    return out


if __name__ == "__main__":
    from .cli import leave

    leave(main())
