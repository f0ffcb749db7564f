"""The planner's choice: compiling the estimate's best 16 against compiling every survivor.

``shardkit autoplan`` compiles only the 16 candidates the pre-compile estimate ranks best
(``--compile-top``). Does it choose what compiling every survivor of the analytic checks
would? On 8 emulated devices (gpt-tiny and llama-tiny, batch 64, every recipe, remat
policy and schedule) every survivor is compiled once into an empty cache; then for
memory budgets at quantiles of the survivors' compiled totals (a tenth of them fit at the
tightest, three quarters at the loosest) the command runs twice on that cache:
``--compile-top 16`` and ``--compile-top`` every survivor. The table gives the survivors,
how many fit once compiled, the share of the survivors whose estimate is within ±10 %
of their compiled total, how many the estimate puts on the wrong side of the budget,
both choices and their roofline step times. (gpt-7b has 642 survivors on 64 devices and
1,053 on 512: about one and three hours of compiling on this 2-core machine, at the 5
to 12 s a compile the auto-planner benchmark takes.)

Run: python benchmarks/planner_choice.py [--tiny]
"""

from __future__ import annotations

import sys
import tempfile

from autoplan import autoplan
from bench_util import MIB, emit, parser

from shardkit.autoplanner.candidates import Candidate

DEVICES, BATCH, TOP = 8, 64, 16
QUANTILES = (0.10, 0.25, 0.50, 0.75)
EVERY = 100_000  # --compile-top larger than any survivor count


def run(model: str, cache: str, budget_bytes: float, top: int, extra: list[str]) -> dict:
    """``shardkit autoplan --json`` on 8 devices with this budget, compiling into ``cache``."""
    flags = ["--batch", str(BATCH), "--compile-top", str(top), "--compile-timeout", "600"]
    got, _ = autoplan(model, DEVICES, [*flags, *extra], memory_gb=budget_bytes / 2**30, cache=cache)
    return got


def label(c: dict) -> str:
    return Candidate.from_json(c).label


def choice_rows(model: str, extra: list[str], cache: str, quantiles=QUANTILES) -> tuple[list, list]:
    """One row per budget (the survivors, what fits, the estimate's misses, both choices),
    and every survivor's label, compiled and estimated total and step time."""
    # Every survivor compiled once (a budget nothing reaches: all fit), into the cache.
    survivors = [
        {
            "candidate": label(c),
            "compiled_bytes": c["memory_per_device_bytes"]["total"],
            "estimated_bytes": c.get("estimated_memory_per_device_bytes"),
            "step_time_s": c["step_time_s"],
        }
        for c in run(model, cache, 2**40, EVERY, extra)["candidates"]
    ]
    estimated = [s for s in survivors if s["estimated_bytes"] is not None]
    near = sum(abs(s["estimated_bytes"] / s["compiled_bytes"] - 1) <= 0.10 for s in estimated)
    within = f"{near / len(estimated):.0%}" if estimated else "–"
    totals = sorted(s["compiled_bytes"] for s in survivors)
    rows = []
    for q in quantiles:
        budget = float(totals[min(len(totals) - 1, int(q * len(totals)))])
        a = run(model, cache, budget, TOP, extra)["candidates"][0]
        b = run(model, cache, budget, EVERY, extra)["candidates"][0]
        wrong = sum(
            (s["estimated_bytes"] > budget) != (s["compiled_bytes"] > budget) for s in estimated
        )
        rows.append(
            [
                model,
                f"{q:.0%}",
                budget * MIB,
                len(survivors),
                sum(s["compiled_bytes"] <= budget for s in survivors),
                within,
                wrong,
                label(b),
                b["step_time_s"] * 1e6,
                label(a),
                a["step_time_s"] * 1e6,
                "yes" if label(a) == label(b) else "no",
            ]
        )
    return rows, survivors


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--cache",
        help="the autoplan cache folder to compile into and read from (default: a fresh "
        "temporary one); a second run on the same folder compiles nothing",
    )
    args = p.parse_args(argv)
    models = ("gpt-tiny",) if args.tiny else ("gpt-tiny", "llama-tiny")
    extra = ["--recipes", "dp,fsdp", "--remat", "none"] if args.tiny else []
    rows, details = [], {}
    with tempfile.TemporaryDirectory() as fresh:
        for model in models:
            quantiles = (0.5,) if args.tiny else QUANTILES
            got, survivors = choice_rows(model, extra, args.cache or fresh, quantiles)
            rows += got
            details[model] = survivors
    emit(
        "planner_choice",
        f"The planner's choice: the estimate's best {TOP} compiled against every survivor "
        f"({DEVICES} devices, batch {BATCH}, compile only)",
        [
            "model",
            "budget at",
            "budget MiB",
            "survivors",
            "fit (compiled)",
            "estimate within ±10 %",
            "estimate on the wrong side",
            "choice, every survivor compiled",
            "step µs",
            f"choice, best {TOP} by estimate compiled",
            "step µs ",
            "same",
        ],
        rows,
        args.out,
        extra={"survivors": details},
    )


if __name__ == "__main__":
    main(sys.argv[1:])
