"""Regenerate every benchmark table, the docs' benchmark pages and the README's headline.

Each benchmark runs in its own process (emulated device counts are per process). The
tables go to ``benchmarks/results/*.json`` and ``benchmarks/results/RESULTS.md``; the docs
pages under ``docs/benchmarks/`` (one per benchmark, stamped with its run, with plots) are
written from those JSON files by ``pages.py``; with ``--readme`` the one headline table
between the BENCHMARKS markers in README.md is replaced too.

Run: python benchmarks/run_all.py [--tiny] [--readme] [--assemble]
(``--assemble`` skips running and rebuilds RESULTS.md, the pages and the README from the
JSON on disk.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_util import parser
from pages import headline, write_pages

HERE = Path(__file__).resolve().parent
SCRIPTS = (
    "layout",
    "memory_terms",
    "overhead",
    "compile_scaling",
    "planning",
    "pipeline",
    "tsp",
    "context_parallel",
    "moe",
    "mla",
    "explicit",
    "autoplan",
    "planner_choice",
    "estimator",
    "gpu",
    "packed",
)
#: Further tables a script writes, after its own.
EXTRA_RESULTS = {
    "planning": ("planning_logits",),
    "pipeline": ("pipeline_3d",),
    "context_parallel": ("context_parallel_long",),
}
BEGIN, END = "<!-- BENCHMARKS:BEGIN -->", "<!-- BENCHMARKS:END -->"


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--readme", action="store_true", help="update README.md's headline table")
    p.add_argument("--assemble", action="store_true", help="only rebuild from results/*.json")
    args = p.parse_args(argv)
    for name in () if args.assemble else SCRIPTS:
        cmd = [sys.executable, str(HERE / f"{name}.py"), "--out", str(args.out)]
        print(f"+ {' '.join(cmd[1:])}{' --tiny' if args.tiny else ''}", flush=True)
        subprocess.run(cmd + (["--tiny"] if args.tiny else []), check=True, cwd=HERE)
    sections = []
    for name in SCRIPTS:
        for part in (name, *EXTRA_RESULTS.get(name, ())):
            result = args.out / f"{part}.json"
            if result.exists():
                sections.append(json.loads(result.read_text())["markdown"])
    text = "\n".join(sections)
    (args.out / "RESULTS.md").write_text(text)
    if args.tiny:  # a smoke run's numbers go nowhere public
        return 0
    for path in write_pages(args.out):
        print(f"wrote {path.relative_to(HERE.parent)}", flush=True)
    table = headline(args.out)
    if args.readme and table is not None:
        readme = HERE.parent / "README.md"
        body = readme.read_text()
        start, end = body.index(BEGIN) + len(BEGIN), body.index(END)
        readme.write_text(body[:start] + "\n" + table + "\n" + body[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
