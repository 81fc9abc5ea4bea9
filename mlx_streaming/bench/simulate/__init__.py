"""bench simulate: project decode tok/s from a routing trace and a
hardware profile, and check the projection against this machine.

The model of one decode token (one token per MoE call):

    compute                 the token's work with every expert resident: the
                            bytes of weights it touches over the bandwidth the
                            compute reaches (or, on this machine, measured)
    + moe_layers x sync     one paged MoE call's cost: its host sync and
                            bookkeeping, or on this machine's CPU backend
                            without prefetch, the call inside the graph
                            (``bench overhead`` measures both paths)
    + reads                 per call with m missed experts: latency + m x
                            (expert bytes / SSD bandwidth + the host's work
                            per missed record), after the sync; on the synced
                            path (``overlap``) less the compute of the call's
                            resident experts, which runs meanwhile

Misses come from replaying the trace through the eviction policy at the
pool size. The calls run one after another on one clock, with the disk as
the native reader drives it (``Disk``), so that with prefetch the
predictions the trace recorded (one and two layers ahead, with their
scores) are read as the live prefetch reads them: the calibration's bar
replayed, at most the bandwidth budget, one at a time behind demand reads,
cancelled when not started by the time their layer arrives, while the
layers before compute. A read ahead in flight when its layer arrives is
waited for; a demand read waits for the read ahead in flight.

Two modes:

  --validate   this machine: measure its profile (resident decode, a
               paged call's cost on each path, throttled disk rate), project
               each pool x policy x prefetch case of a model with the path it
               ran, run those cases with ``bench decode`` in the same run and
               report the error of each projection.
  --project    Apple Silicon profiles (published figures, sources in
               PROFILES) x large MoE models at 4 bits: projected tok/s at the
               largest pool each machine's memory allows. Hit rates come from
               the given trace at the same pool fraction: a proxy, since no
               trace of those models was recorded here.
"""

from pathlib import Path

from ...config import DEFAULT_POLICY
from ..common import BenchError
from .model import project_case  # noqa: F401  (the tests and scripts replay with it)
from .machines import SHAPES  # noqa: F401
from .project import project
from .validate import validate
from ...flags import MAX_ROUNDS, MAX_TOKENS, count, existing_file, number, temperature


def add_arguments(p) -> None:
    p.add_argument("--validate", action="store_true",
                   help="measure this machine and check projections against bench decode")
    p.add_argument("--project", action="store_true",
                   help="project Apple Silicon machines x large MoE models (needs --trace "
                        "or --model for hit rates)")
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
    p.add_argument("--policies", default=DEFAULT_POLICY)
    p.add_argument("--prefetch", default="off", help="off, next-layer, or both comma-separated")
    p.add_argument("--prefetch-precision", type=number(0, 1), default=None,
                   help="prefetch_precision of the decode and overhead cases (validate) or "
                        "of the projection (default: load()'s)")
    p.add_argument("--prefetch-depth", default=None,
                   help="prefetch_depth, comma-separated to compare (e.g. 1,2; default: "
                        "load()'s)")
    p.add_argument("--read-mbps", type=number(0, open_low=True), default=None,
                   help="validate with reads throttled (cgroup blkio), as bench decode")
    p.add_argument("--pace-mbps", type=number(0, open_low=True), default=None,
                   help="validate with the reader emulating a disk of this rate "
                        "(read_pace_mbps), as bench decode")
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=32)
    p.add_argument("--temp", type=temperature, default=0.0)
    p.add_argument("--repeats", type=count(1, MAX_ROUNDS), default=1)
    p.add_argument("--out", type=Path, default=Path("bench-results/simulate"))


def run(args) -> dict:
    if args.validate == args.project:
        raise BenchError("bench simulate needs exactly one of --validate or --project")
    args.out.mkdir(parents=True, exist_ok=True)
    return validate(args) if args.validate else project(args)
