"""bench simulate: predict's speed model (``predict/speed.py``, docs/predict.md)
on this machine and on Apple Silicon profiles.

  --validate   this machine: measure its costs (resident decode, a paged
               call's cost on each path, the reader's rate), run each pool x
               policy x prefetch case with ``bench decode`` in the same run,
               and report the error of predict's forecast of each at the hit
               rate it measured (prefetch's overlap is not in the model).
  --project    predict's Mac profiles x the large models of its validation
               (``predict/data/published.json``), each at the largest budget
               the machine holds: projected tok/s with the hit rates of a
               recorded routing trace, replayed through each policy and
               carried to the model's experts and top-k as predict carries
               its curves (projections, not measurements).
"""

from pathlib import Path

from ...config import add_option_flag
from ...flags import MAX_ROUNDS, MAX_TOKENS, count, existing_file, temperature
from ..inputs import BenchError, add_option_list_flag, add_read_rate_flags
from .project import project
from .validate import validate


def add_arguments(p) -> None:
    p.add_argument("--validate", action="store_true",
                   help="measure this machine's costs and check predict's speed model "
                        "against bench decode")
    p.add_argument("--project", action="store_true",
                   help="project Apple Silicon machines x large MoE models with predict's "
                        "speed model (needs --trace or --model for hit rates)")
    p.add_argument("--model", help="stream directory (validate: the model run)")
    p.add_argument("--mlx-model", help="the same model as an mlx-lm directory (validate)")
    p.add_argument("--trace", type=existing_file, help="routing trace for --project hit rates")
    p.add_argument("--quality", type=existing_file,
                   help="project: add a row per approximate setting of this bench quality "
                        "JSON (its bytes read per token against exact's)")
    p.add_argument("--ranks", default="1",
                   help="project: Macs splitting each model tensor parallel, comma-separated "
                        "(e.g. 1,2,4): each holds a slice of every expert and reads it from "
                        "its own SSD")
    p.add_argument("--pools", default="0.25,0.5")
    add_option_list_flag(p, "policy", "--policies")
    add_option_list_flag(p, "prefetch", note="validate (project: off)")
    add_option_flag(p, "prefetch_precision", note="validate: the decode and overhead cases")
    add_option_list_flag(p, "prefetch_depth", note="validate")
    add_read_rate_flags(p, "the validation's", pace=True)
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=32)
    p.add_argument("--temp", type=temperature, default=0.0)
    p.add_argument("--repeats", type=count(1, MAX_ROUNDS), default=1)
    p.add_argument("--out", type=Path, default=Path("bench-results/simulate"))


def run(args) -> dict:
    if args.validate == args.project:
        raise BenchError("bench simulate needs exactly one of --validate or --project")
    args.out.mkdir(parents=True, exist_ok=True)
    return validate(args) if args.validate else project(args)
