"""The pre-compile estimate (``sk.estimate``) against the compiled program.

Compile only (nothing runs), AdamW. Four grids of points, every recipe × both families
(GPT: linen, tied, LayerNorm; Llama: NNX, RMSNorm, SwiGLU) × a rotation of remat
(full / none / save_dots) and precision (f32 / bf16):

- *training*: d_model 128, 2 layers, vocab 1024, seq 64, global batch 16, on 4 and 8
  devices;
- *training_large*: the training grid at batch 512 (2,048 to 32,768 tokens per
  device, where XLA:CPU holds more of the backward layer's values: see
  ``large_rows``);
- *held-out*: d_model 256, 4 layers, vocab 2048, seq 128, global batch 32, on 16
  devices (other sizes, sequence, batch and device count than the fit ever saw; its
  pipelined recipes on the default, rolled, engine: two layers a stage, which the
  estimator does not cover on the unrolled one; ``pp``'s 16 stages are refused);
  each with three (remat, precision) pairs per recipe × family (the six pairs rotate
  over the recipes);
- *held_out_large*: the held-out grid at batch 512 (4,096 to 65,536 tokens per device);
- *held_out_vocab*: the training grid's models with vocab 8192, 64 times d_model (as
  gpt-small's 50,257 over 768), larger than a step's 1,024 tokens, where the other
  grids' vocabularies are no larger than their tokens: XLA scatters the lookup's
  gradient into the table's shard there, and a vocabulary-split head holds its shard's
  gradient;
- *moe_tiny*, *moe_small*: mixture-of-experts points (:data:`MOE_GRIDS`), the four
  expert-parallel recipes on 8 devices, f32; moe_tiny fits one constant (the MoE MLP's
  share, ``moe_backward_fraction``, the others held), moe_small judges it.
- *held_out_wide*: the planner's own candidates at 64 and 512 devices (d_model 512,
  8 layers, vocab 4096, seq 128, global batch 512: 128 to 1,024 tokens per device), a
  seeded sample of :data:`WIDE_PER_RECIPE` per recipe × family × device count from those
  that pass the planner's structural checks, over its meshes, remat, precision,
  micro-batches, schedules, logits layouts and attention strategies; never in the fit.
- *rolled_training*, *rolled_held_out*: the rolled pipeline engine (the default), each
  point with its mesh and pipeline options (:data:`PIPELINE_GRIDS`): pp / dp_pp / zeropp
  / dp_tp_sp_pp × gpipe / 1f1b / interleaved / zb1 / zbv × remat full / none; training
  on 8 devices at d_model 128, held-out on 16 at d_model 256 and a wider model with a
  larger vocabulary (sizes, sequence, batch, device count and micro-batches the fit
  never saw), gpt-tiny / llama-tiny on 8 (one layer per stage), and held-out points
  under remat save_dots and bf16 (f32 and full / none everywhere else);
  *rolled_training_large* and *rolled_held_out_large* (:data:`LARGE_PIPELINE_GRIDS`):
  the engine at 1,024 to 16,384 tokens a micro-batch (the training_large grid's
  pipelined points with 1F1B and a micro-batch per stage; the rolled_held_out rows at 16x
  their batch); the first fits one constant alone (``rolled_pair_fraction``: its points
  are all two stages of one layer), the second judges it.

Each point's compiled figures (arguments, temp at the peak, total, wire by kind, the
itemised temp terms) are cached in ``results/estimator_points.json``, so a rerun only
compiles what is new. The constants of :mod:`shardkit.report.estimator` that are fitted
(named there) are fitted on the training and training_large grids (the rolled engine's
on rolled_training, the one-layer pair's on rolled_training_large, the MoE MLP's on
moe_tiny); the errors on every grid, per recipe family, go to
``results/estimator.json``.

``--tiny`` compiles the training grid's first point (no cache) and reports on it.

Run: python benchmarks/estimator.py [--tiny] [--collect GRID] [--fit [NAMES]]
"""

from __future__ import annotations

import sys

import shardkit as sk

if "--collect" in sys.argv or "--tiny" in sys.argv:
    import os

    from shardkit.devices import compile_only_env

    os.environ.update(compile_only_env(os.environ))  # the buffers as at -O2, compiled faster
    sk.emulate_devices(512 if "held_out_wide" in sys.argv else 16)

import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from bench_util import OUT, emit, parser  # noqa: E402

from shardkit import recipes  # noqa: E402
from shardkit.errors import ShardingError  # noqa: E402

CACHE = OUT / "estimator_points.json"  # every grid's compiled points


def cache_file(grid: str):
    """Where a collection writes (one file per grid, merged into ``CACHE`` after)."""
    return OUT / f"estimator_points_{grid}.json"


REMATS = ("full", "none", "save_dots")
#: (remat, precision) pairs per recipe × family: 3 of the 6, rotating, so that each grid
#: covers all six across the recipes: 114 points a grid, of which the training and
#: held-out grids compile 108 (``pp`` over 4 or 8 stages of 2 layers, and 16 of 4, is
#: refused). A grid's new points compile in ~5-25 minutes on this 2-core machine.
PER_CELL = 3
PRECISIONS = ("f32", "bf16")

#: The grids: model sizes, step sizes and device counts (see the module docstring).
GRIDS = {
    "training": {
        "gpt": dict(vocab=1024, d_model=128, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=512),
        "llama": dict(vocab=1024, d_model=128, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=384),
        "seq": 64,
        "batch": 16,
        "devices": (8, 4),
    },
    "held_out": {
        "gpt": dict(vocab=2048, d_model=256, n_layers=4, n_heads=16, n_kv_heads=16, d_ff=1024),
        "llama": dict(vocab=2048, d_model=256, n_layers=4, n_heads=16, n_kv_heads=16, d_ff=768),
        "seq": 128,
        "batch": 32,
        "devices": (16,),
        # its pipelined recipes on the default (rolled) engine: the estimator does not
        # cover the unrolled one beyond a layer a stage, and these hold two
        "engine": "rolled",
    },
}

#: The training grid's models and devices at 32x its batch: 2,048 to 32,768 tokens
#: per device, where XLA:CPU's programs hold more of the backward layer's values
#: (from 4,096 rows per matmul it materialises operands it fuses below). The fit
#: sees it beside the training grid.
GRIDS["training_large"] = {**GRIDS["training"], "batch": 512}
#: The held-out grid at 16x its batch (4,096 to 65,536 tokens per device): the
#: large-rows regime on sizes the fit never saw.
GRIDS["held_out_large"] = {**GRIDS["held_out"], "batch": 512}
#: The training grid's models with a vocabulary 64 times their width (gpt-small's
#: 50,257 over 768), larger than the 1,024 tokens of a step: XLA then scatters the
#: lookup's gradient into the table's shard and a head on the stored shard holds its
#: shard's gradient (the other grids' vocabularies are no larger than their tokens).
GRIDS["held_out_vocab"] = {
    **GRIDS["training"],
    "gpt": {**GRIDS["training"]["gpt"], "vocab": 8192},
    "llama": {**GRIDS["training"]["llama"], "vocab": 8192},
}


#: Mixture-of-experts points (moe-tiny's and moe-small's shapes, both with one shared
#: expert, capacity factor 1.25, 8 devices): the four expert-parallel recipes × remat;
#: moe_tiny fits the MoE MLP's share (moe_backward_fraction; the dense constants held),
#: moe_small judges it.
MOE_RECIPES = ("ep", "fsdp_ep", "ep_tp", "ep_gspmd")
MOE_GRIDS = {
    "moe_tiny": {
        "config": dict(
            vocab=256,
            d_model=64,
            n_layers=2,
            n_heads=16,
            n_kv_heads=8,
            d_ff=64,
            n_experts=8,
            top_k=2,
            n_shared_experts=1,
        ),
        "seq": 64,
        "batch": 16,
        "remats": REMATS,
    },
    "moe_small": {
        "config": dict(
            vocab=32000,
            d_model=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=4,
            d_ff=2048,
            n_experts=8,
            top_k=2,
            n_shared_experts=1,
        ),
        "seq": 128,
        "batch": 8,
        "remats": ("full",),
    },
}


def _pp(family, config, recipe, mesh, batch, seq, remat, pipeline, precision="f32", *, grid):
    return dict(
        grid=grid,
        family=family,
        config={**config, "max_seq": seq},
        recipe=recipe,
        devices=math.prod(mesh.values()),
        mesh=mesh,
        batch=batch,
        seq=seq,
        remat=remat,
        precision=precision,
        pipeline=pipeline,
    )


_T_GPT = dict(vocab=1024, d_model=128, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=512)
_T_LLAMA = dict(vocab=1024, d_model=128, n_layers=8, n_heads=8, n_kv_heads=8, d_ff=384)
_H_GPT = dict(vocab=2048, d_model=256, n_layers=4, n_heads=16, n_kv_heads=16, d_ff=1024)
_H_LLAMA = dict(vocab=2048, d_model=256, n_layers=4, n_heads=16, n_kv_heads=4, d_ff=768)
_H_WIDE = dict(vocab=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=2048)
_GPT_TINY = dict(vocab=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=8, d_ff=256)
_LLAMA_TINY = dict(vocab=256, d_model=64, n_layers=2, n_heads=16, n_kv_heads=8, d_ff=256)
_S2F4, _S2F8 = {"data": 1, "stage": 2, "fsdp": 4}, {"data": 1, "stage": 2, "fsdp": 8}
_S2D8 = {"stage": 2, "data": 8}
_3D8, _3D16 = {"data": 2, "stage": 2, "tensor": 2}, {"data": 4, "stage": 2, "tensor": 2}


def _sch(name, m, **kw):
    return {"schedule": name, "microbatches": m, **kw}


def _ilv(m):
    return _sch("interleaved", m, virtual_stages=2)


_T_GPT4 = {**_T_GPT, "n_layers": 4}  # one layer per chunk under interleaved on 2 stages


#: The rolled pipeline engine's points: (family, config, recipe, mesh, batch, seq, remat,
#: pipeline options[, precision]) per grid; the training grid on 8 devices, the held-out
#: one on 16; f32 unless a row says bf16.
PIPELINE_GRIDS = {
    "rolled_training": [
        ("gpt", _T_GPT, "pp", {"stage": 8}, 16, 64, "full", _sch("1f1b", 8)),
        ("llama", _T_LLAMA, "pp", {"stage": 8}, 16, 64, "none", _sch("gpipe", 8)),
        ("gpt", _T_GPT, "dp_pp", {"stage": 2, "data": 4}, 16, 64, "none", _sch("1f1b", 4)),
        ("llama", _T_LLAMA, "dp_pp", {"stage": 2, "data": 4}, 16, 64, "full", _sch("gpipe", 2)),
        ("gpt", _T_GPT, "zeropp", _S2F4, 16, 64, "full", _sch("1f1b", 4)),
        ("llama", _T_LLAMA, "zeropp", _S2F4, 16, 64, "none", _sch("1f1b", 4, unit=2)),
        ("gpt", _T_GPT, "dp_tp_sp_pp", _3D8, 16, 64, "full", _sch("1f1b", 4)),
        ("llama", _T_LLAMA, "dp_tp_sp_pp", _3D8, 16, 64, "none", _ilv(4)),
        ("gpt", _T_GPT, "dp_pp", {"stage": 2, "data": 4}, 16, 64, "full", _ilv(4)),
        ("gpt", _T_GPT, "zeropp", _S2F4, 16, 64, "none", _sch("gpipe", 4)),
        ("llama", _T_LLAMA, "pp", {"stage": 8}, 16, 64, "full", _sch("1f1b", 16)),
        ("gpt", _T_GPT, "dp_pp", {"stage": 2, "data": 4}, 16, 64, "full", _sch("zb1", 4)),
        ("llama", _T_LLAMA, "zeropp", _S2F4, 16, 64, "none", _sch("zbv", 4)),
        ("gpt", _T_GPT, "pp", {"stage": 8}, 16, 64, "none", _sch("zb1", 8)),
        ("llama", _T_LLAMA, "dp_pp", {"stage": 2, "data": 4}, 16, 64, "full", _ilv(4)),
        ("gpt", _T_GPT4, "dp_pp", {"stage": 2, "data": 4}, 16, 64, "full", _ilv(4)),
    ],
    "rolled_held_out": [
        ("gpt", _H_GPT, "zeropp", _S2F8, 32, 128, "full", _sch("1f1b", 4)),
        ("llama", _H_LLAMA, "zeropp", _S2F8, 32, 128, "none", _sch("gpipe", 2)),
        ("gpt", _H_GPT, "dp_pp", {"stage": 2, "data": 8}, 32, 128, "none", _sch("1f1b", 2)),
        ("llama", _H_LLAMA, "dp_tp_sp_pp", _3D16, 32, 128, "full", _sch("1f1b", 4)),
        ("gpt", _H_GPT, "dp_tp_sp_pp", _3D16, 32, 128, "none", _sch("gpipe", 4)),
        ("llama", _H_LLAMA, "dp_pp", {"stage": 2, "data": 8}, 32, 128, "full", _ilv(4)),
        ("gpt", _H_GPT, "pp", {"stage": 4}, 8, 128, "full", _sch("1f1b", 8)),
        ("gpt", _H_WIDE, "zeropp", _S2F8, 32, 128, "full", _sch("1f1b", 4, unit=2)),
        ("gpt", _H_WIDE, "dp_pp", {"stage": 2, "data": 8}, 32, 128, "none", _sch("zb1", 2)),
        ("llama", _H_LLAMA, "zeropp", _S2F8, 32, 128, "full", _sch("zbv", 4)),
        ("gpt", _H_GPT, "dp_pp", {"stage": 2, "data": 8}, 32, 128, "full", _ilv(4)),
        # gpt-tiny / llama-tiny (8 devices): one layer per stage, every tick unrolled
        ("llama", _LLAMA_TINY, "zeropp", _S2F4, 16, 64, "none", _sch("1f1b", 4)),
        ("gpt", _GPT_TINY, "dp_pp", {"stage": 2, "data": 4}, 16, 64, "full", _sch("zb1", 2)),
        ("gpt", _GPT_TINY, "dp_pp", {"stage": 2, "data": 4}, 8, 64, "full", _sch("1f1b", 2)),
        # save_dots and bf16 (the fit saw neither on the rolled engine)
        ("gpt", _H_GPT, "zeropp", _S2F8, 32, 128, "save_dots", _sch("1f1b", 4)),
        ("llama", _H_LLAMA, "dp_pp", _S2D8, 32, 128, "full", _sch("1f1b", 4), "bf16"),
        ("gpt", _H_GPT, "dp_tp_sp_pp", _3D16, 32, 128, "save_dots", _sch("zb1", 4), "bf16"),
        ("llama", _H_LLAMA, "zeropp", _S2F8, 32, 128, "none", _sch("gpipe", 2), "bf16"),
    ],
}


#: The planner's candidates at 64 and 512 devices (sizes the fit never saw): a seeded
#: sample of this many per recipe × family × device count, from those the planner's
#: structural checks pass (``autoplanner.evaluate.prune``, no memory budget), and one
#: more of a pipeline's interleaved over 4 or 8 chunks a stage.
WIDE_PER_RECIPE = 3
WIDE_GRIDS = {
    "held_out_wide": {
        "gpt": dict(vocab=4096, d_model=512, n_layers=8, n_heads=16, n_kv_heads=16, d_ff=2048),
        "llama": dict(vocab=4096, d_model=512, n_layers=8, n_heads=16, n_kv_heads=8, d_ff=1536),
        "seq": 128,
        "batch": 512,
        "devices": (64, 512),
    }
}


@functools.cache
def _wide_points(grid: str) -> tuple:
    import random

    from shardkit.autoplanner.candidates import enumerate_candidates
    from shardkit.autoplanner.evaluate import Pruned, Subject, _pipeline_options, prune

    g, out = WIDE_GRIDS[grid], []
    for devices in g["devices"]:
        for family in ("gpt", "llama"):
            p0 = dict(family=family, config={**g[family], "max_seq": g["seq"]}, remat="full")
            subject = Subject.of(model_of(p0), batch=g["batch"], seq=g["seq"])
            by_recipe: dict[str, list] = {}
            for c in enumerate_candidates(
                devices, g["batch"], remats=REMATS, precisions=PRECISIONS
            ):
                if c.recipe in MOE_RECIPES:
                    continue
                if not isinstance(prune(subject, c, budget=math.inf), Pruned):
                    # interleaved over 4 or 8 chunks: one more point of its own
                    by_recipe.setdefault((c.recipe, c.chunks is None), []).append(c)
            for (recipe, default_chunks), cands in by_recipe.items():
                seed = f"{grid}/{devices}/{family}/{recipe}" + ("" if default_chunks else "/v")
                random.Random(seed).shuffle(cands)
                for c in cands[: WIDE_PER_RECIPE if default_chunks else 1]:
                    pipe = _pipeline_options(c) if c.microbatches is not None else None
                    out.append(
                        dict(
                            _pp(
                                family,
                                g[family],
                                recipe,
                                c.mesh_sizes,
                                g["batch"],
                                g["seq"],
                                c.remat,
                                pipe,
                                c.precision,
                                grid=grid,
                            ),
                            candidate=c.to_json(),
                        )
                    )
    return tuple(out)


def recipe_of(p: dict):
    """The recipe a point compiles: a planner candidate's own (its logits layout,
    attention strategy and data axis), else the registered one by name."""
    if "candidate" not in p:
        return p["recipe"]
    from shardkit.autoplanner.candidates import Candidate

    return Candidate.from_json(p["candidate"]).recipe_object()


def _on_the_default_engine(grid: str) -> list[dict]:
    """training_large's pipelined points on the rolled engine: 1F1B, a micro-batch per
    stage, the recipe's default mesh (pp over 4 and 8 stages is refused there: 2 layers)."""
    out = []
    for p in points("training_large"):
        r = recipes.get(p["recipe"])
        sizes = dict(r.axis_sizes(p["devices"]))
        stage = r.parallelism(sizes).stage
        if stage > 1:
            pipe = {"schedule": "1f1b", "microbatches": stage}
            out.append(dict(p, grid=grid, mesh=sizes, pipeline=pipe))
    return out


def _at_16x_the_batch(grid: str) -> list[dict]:
    """The rolled_held_out rows at 16x their batch."""
    return [dict(p, grid=grid, batch=16 * p["batch"]) for p in pipeline_points("rolled_held_out")]


#: The rolled engine at 1,024 to 16,384 tokens a micro-batch, where a layer's backward
#: working set outweighs the stage's buffers: each grid's points, built from another's.
LARGE_PIPELINE_GRIDS = {
    "rolled_training_large": _on_the_default_engine,
    "rolled_held_out_large": _at_16x_the_batch,
}
PIPELINE_GRIDS.update(dict.fromkeys(LARGE_PIPELINE_GRIDS, ()))  # listed with the others


def pipeline_points(grid: str) -> list[dict]:
    """A rolled pipeline grid's points (:data:`PIPELINE_GRIDS`, :data:`LARGE_PIPELINE_GRIDS`)."""
    if grid in LARGE_PIPELINE_GRIDS:
        return LARGE_PIPELINE_GRIDS[grid](grid)
    return [_pp(*row, grid=grid) for row in PIPELINE_GRIDS[grid]]


def moe_points(grid: str) -> list[dict]:
    """A MoE grid's points: every expert-parallel recipe × its remat policies, f32."""
    g = MOE_GRIDS[grid]
    return [
        dict(
            grid=grid,
            family="moe",
            config={**g["config"], "max_seq": g["seq"]},
            recipe=recipe,
            devices=8,
            batch=g["batch"],
            seq=g["seq"],
            remat=remat,
            precision="f32",
        )
        for recipe in MOE_RECIPES
        for remat in g["remats"]
    ]


def points(grid: str) -> list[dict]:
    """The grid's points: every recipe × family × ``PER_CELL`` (remat, precision) pairs."""
    if grid in MOE_GRIDS:
        return moe_points(grid)
    if grid in PIPELINE_GRIDS:
        return pipeline_points(grid)
    if grid in WIDE_GRIDS:
        return [dict(p) for p in _wide_points(grid)]
    g = GRIDS[grid]
    combos = [(r, p) for r in REMATS for p in PRECISIONS]
    out = []
    for i, recipe in enumerate(r for r in recipes.names() if r not in MOE_RECIPES):
        for j, family in enumerate(("gpt", "llama")):
            for k in range(PER_CELL):
                remat, precision = combos[(2 * i + 3 * j + k * 2 + k // 2) % len(combos)]
                devices = g["devices"][(i + j + k) % len(g["devices"])]
                out.append(
                    dict(
                        grid=grid,
                        family=family,
                        config={**g[family], "max_seq": g["seq"]},
                        recipe=recipe,
                        devices=devices,
                        batch=g["batch"],
                        seq=g["seq"],
                        remat=remat,
                        precision=precision,
                    )
                )
                if g.get("engine") and family_of(recipe) == "pipeline":
                    out[-1]["engine"] = g["engine"]
    return out


def key(p: dict) -> str:
    c = p["config"]
    size = "-".join(str(c[k]) for k in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads"))
    if c.get("n_experts"):
        size += f"-e{c['n_experts']}k{c['top_k']}s{c.get('n_shared_experts', 0)}"
    out = (
        f"{p['family']}-{size}-{c['d_ff']}/{p['recipe']}/{p['devices']}/"
        f"b{p['batch']}s{p['seq']}/{p['remat']}/{p['precision']}"
    )
    if p.get("engine"):  # a pipelined point on the default engine, not the unrolled one
        out += f"/{p['engine']}"
    if p.get("pipeline"):  # the rolled engine's points: their mesh and schedule
        mesh = "x".join(f"{a}{n}" for a, n in p["mesh"].items())
        opts = ",".join(f"{k}={v}" for k, v in sorted(p["pipeline"].items()))
        out += f"/{mesh}/rolled:{opts}"
    elif p.get("candidate"):  # a planner candidate: its mesh and recipe options
        c = p["candidate"]
        out += "/" + "x".join(f"{a}{n}" for a, n in p["mesh"].items())
        out += "".join(f"/{k}={c[k]}" for k in ("logits", "attention") if c.get(k))
    return out


def load_cache() -> dict:
    out: dict = {}
    grids = (*GRIDS, *MOE_GRIDS, *PIPELINE_GRIDS, *WIDE_GRIDS)
    for path in (CACHE, *(cache_file(g + r) for g in grids for r in ("", "_reversed"))):
        out.update(json.loads(path.read_text()) if path.exists() else {})
    return out


def model_of(p: dict):
    from shardkit import models

    base = {"gpt": "gpt-tiny", "llama": "llama-tiny", "moe": "moe-tiny"}[p["family"]]
    return models.get(base, remat=p["remat"], **p["config"])


def pipeline_of(p: dict) -> dict | None:
    """The pipeline options a point compiles with: the rolled grids' own; a point with
    ``engine="rolled"`` (the held-out grids') the defaults; the other grids' pipelined
    recipes the unrolled engine (their points compiled before the rolled engine was the
    default, and ``--collect`` keeps them comparable)."""
    if p.get("pipeline"):
        return p["pipeline"]
    if p.get("engine") == "rolled":
        return None
    return {"rolled": False} if family_of(p["recipe"]) == "pipeline" else None


def compile_point(p: dict) -> dict:
    """The compiled figures of one point (or why it does not compile)."""
    import jax

    start = time.perf_counter()
    try:
        devices = jax.devices()[: p["devices"]]
        where = {"devices": devices}
        if p.get("mesh"):
            where = {"mesh": sk.make_mesh(p["mesh"], devices=devices)}
        plan = sk.Plan(recipe_of(p), **where, precision=p["precision"])
        r = sk.report.build_report(
            plan,
            model=model_of(p),
            batch=p["batch"],
            seq=p["seq"],
            pipeline=pipeline_of(p),
            itemise=True,
        )
    except ShardingError as e:
        return {"skipped": str(e).splitlines()[0]}
    j = r.to_json()
    return {
        "mesh": j["mesh"],
        "memory": j["memory_per_device_bytes"],
        "wire": j["wire_bytes_by_kind"],
        "analytic_wire": j.get("analytic_wire_bytes_by_kind"),
        "analytic_total": (j.get("analytic_memory_per_device_bytes") or {}).get("total"),
        "peak_phase": j.get("memory_peak_phase"),
        "terms": {t["term"]: t["bytes"] for t in j.get("memory_terms") or []},
        "compile_s": round(time.perf_counter() - start, 2),
    }


def collect(grid: str, tiny: bool = False, reverse: bool = False) -> None:
    cache = load_cache()
    todo = [p for p in points(grid) if key(p) not in cache][:: -1 if reverse else 1]
    for n, p in enumerate(todo[:3] if tiny else todo):
        cache[key(p)] = compile_point(p)
        print(
            f"{n + 1}/{len(todo)} {key(p)} {cache[key(p)].get('compile_s', 'skipped')}", flush=True
        )
        mine = {key(q): cache[key(q)] for q in points(grid) if key(q) in cache}
        out = cache_file(grid + ("_reversed" if reverse else ""))
        out.write_text(json.dumps(mine, indent=1, sort_keys=True))


def dims_of(p: dict):
    from shardkit.models.config import ModelConfig

    return ModelConfig(p["family"], **p["config"]).dims()


def family_of(recipe: str) -> str:
    """The recipe's family for the error table: pipelines, ring attention (context
    parallelism and TSP), or dense."""
    r = recipes.get(recipe)
    if r.parallelism(r.axis_sizes(8)).stage > 1:
        return "pipeline"
    return "dense" if r.attention == "dense" else "ring (cp, tsp)"


#: Recipes whose layout changed after their cached points compiled: left out of the
#: errors until recompiled (delete their entries and --collect again). None today.
STALE: tuple[str, ...] = ()


def compiled(grid: str) -> list[tuple[dict, dict]]:
    cache = load_cache()
    return [
        (p, cache[key(p)])
        for p in points(grid)
        if "memory" in cache.get(key(p), {"x": 0}) and p["recipe"] not in STALE
    ]


def estimates(rows, fit=None) -> list:
    from shardkit.report.estimator import estimate

    return [
        estimate(
            recipe_of(p),
            dims_of(p),
            mesh=c["mesh"],
            batch=p["batch"],
            seq=p["seq"],
            remat=p["remat"],
            precision=p["precision"],
            pipeline=pipeline_of(p),
            fit=fit,
        )
        for p, c in rows
    ]


#: The constants the fit moves (bounded by what they mean; heap_fragmentation to 5 %:
#: free, it grows to scale every term and the others shrink); the others keep the value
#: counted from XLA's buffers (gradient_copies 1: one accumulator per scan buffer;
#: bf16_activation_bytes 4: XLA:CPU's f32 copies; scattered_layer_gradient ⅓: the share
#: of a layer's gradient fsdp holds whole).
FITTED = {
    "backward_layer_fraction": (0.2, 1.5),
    "backward_save_dots_fraction": (0.2, 1.5),
    "backward_none_fraction": (0.0, 1.5),
    "backward_width_values": (0.0, 16.0),
    "backward_width_values_none": (0.0, 16.0),
    "tensor_width_values": (0.0, 16.0),
    "tensor_reduction_fraction": (0.0, 1.5),
    "large_rows_width_values": (0.0, 16.0),
    "gathered_weight_copies": (1.0, 3.0),
    "head_copies": (0.5, 3.0),
    "heap_fragmentation": (0.0, 0.05),
}


def _minimise(rows, fit: dict, bounds: dict, squared: bool = False) -> dict[str, float]:
    """``fit`` with the constants ``bounds`` names refitted (Powell, within those
    bounds) to minimise the mean absolute (or ``squared``) log error of the totals on
    ``rows``, the others held."""
    import numpy as np
    from scipy.optimize import minimize

    names = list(bounds)
    actual = np.array([c["memory"]["total"] for _, c in rows])

    def loss(x):
        est = np.array(
            [e.total for e in estimates(rows, {**fit, **dict(zip(names, x, strict=True))})]
        )
        err = np.log(est / actual)
        return float(np.mean(err**2 if squared else np.abs(err)))

    x0 = np.array([fit[n] for n in names])
    res = minimize(loss, x0, method="Powell", bounds=list(bounds.values()))
    return {**fit, **{n: round(float(v), 3) for n, v in zip(names, res.x, strict=True)}}


def fit_constants(rows, names: Sequence[str] = ()) -> dict[str, float]:
    """The :data:`FITTED` constants (or those ``names``, the others held) minimising the
    mean absolute log error of the totals on ``rows`` (the training grid), within their
    bounds: the absolute error, not its square, so that a few points no constant reaches
    do not pull the rest off."""
    from shardkit.report.estimator import FIT

    unknown = sorted(set(names) - set(FITTED))
    if unknown:
        raise SystemExit(
            f"--fit NAMES refits the dense constants only; {unknown} are not among them: "
            f"{', '.join(FITTED)} (a bare --fit refits the rolled and MoE ones too)"
        )
    return _minimise(rows, dict(FIT), {n: FITTED[n] for n in names or FITTED})


#: The rolled pipeline engine's constants, fitted on the rolled training grid alone
#: (the dense constants held at their fit): the share of the head's working set a
#: tick's backward overlaps, one layer's backward working set without remat (under
#: remat, rolled_remat_fraction is held: the sixteen points cannot tell it from the
#: overlap).
ROLLED_FITTED = {
    "rolled_head_overlap": (0.0, 1.0),
    "rolled_backward_fraction": (0.0, 1.5),
}


def fit_rolled(rows, fit: dict) -> dict[str, float]:
    """:data:`ROLLED_FITTED` minimising the mean squared log error of the totals on
    ``rows`` (the rolled training grid), the other constants ``fit``'s: squared, as
    sixteen points leave the absolute error flat along a trade of the head's overlap
    for the layer's backward."""
    return _minimise(rows, fit, ROLLED_FITTED, squared=True)


#: The second backward working set of two one-layer stages (rolled_pair_fraction),
#: fitted on rolled_training_large alone (every point of it is such a stage; the other
#: constants held at their fit); rolled_held_out and rolled_held_out_large judge it.
PAIR_FITTED = {"rolled_pair_fraction": (0.0, 1.5)}


def fit_pair(rows, fit: dict) -> dict[str, float]:
    """:data:`PAIR_FITTED` minimising the mean absolute log error of the totals on
    ``rows`` (the rolled_training_large grid), the other constants ``fit``'s."""
    return _minimise(rows, fit, PAIR_FITTED)


#: The MoE MLP's share of its values in the backward layer, fitted on moe_tiny alone
#: (the dense constants held at their fit); moe_small judges it.
MOE_FITTED = {"moe_backward_fraction": (0.2, 1.5)}


def fit_moe(rows, fit: dict) -> dict[str, float]:
    """:data:`MOE_FITTED` minimising the mean absolute log error of the totals on ``rows``
    (the moe_tiny grid), the other constants ``fit``'s."""
    return _minimise(rows, fit, MOE_FITTED)


def errors(rows, ests) -> dict:
    """Per family and overall: points, fraction within ±10 %, the worst error."""
    out: dict[str, dict] = {}
    for (p, c), e in zip(rows, ests, strict=True):
        err = e.total / c["memory"]["total"] - 1
        family = "experts (ep)" if p["family"] == "moe" else family_of(p["recipe"])
        for fam in ("all", family):
            f = out.setdefault(
                fam,
                {"points": 0, "within": 0, "worst": 0.0, "worst_point": "", "wire": 0, "wired": 0},
            )
            f["points"] += 1
            f["within"] += abs(err) <= 0.10
            wire = sum(c["wire"].values())
            if wire:  # the wire estimate within ±5 % of the compiled wire bytes
                f["wired"] += 1
                f["wire"] += abs(e.wire_bytes / wire - 1) <= 0.05
            if abs(err) > abs(f["worst"]):
                f["worst"], f["worst_point"] = round(err, 3), key(p)
    for f in out.values():
        f["within_10pct"] = round(f.pop("within") / f["points"], 3)
        wired = f.pop("wired")
        f["wire_within_5pct"] = round(f.pop("wire") / wired, 3) if wired else None
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--collect", choices=(*GRIDS, *MOE_GRIDS, *PIPELINE_GRIDS, *WIDE_GRIDS))
    p.add_argument("--reverse", action="store_true", help="collect the grid's last points first")
    p.add_argument(
        "--fit",
        nargs="?",
        const="",
        metavar="NAMES",
        help="refit the constants: the dense ones on training and training_large, then the "
        "rolled engine's on rolled_training and rolled_training_large and the MoE MLP's on "
        "moe_tiny (NAMES, "
        "comma-separated: only those dense ones, the others held)",
    )
    args = p.parse_args()
    if args.collect:
        collect(args.collect, args.tiny, args.reverse)
        return
    from shardkit.report.estimator import FIT

    train, held = compiled("training"), compiled("held_out")
    large = compiled("training_large")
    if args.tiny:  # a smoke run: one point compiled here, nothing cached
        train, held, large = [(p, compile_point(p)) for p in points("training")[:1]], [], []
    refit = args.fit is not None
    names = [n.strip() for n in (args.fit or "").split(",") if n.strip()]
    fit = fit_constants(train + large, names) if refit else dict(FIT)
    if refit and not names:
        fit = fit_rolled(compiled("rolled_training"), fit)
        fit = fit_pair(compiled("rolled_training_large"), fit)
        fit = fit_moe(compiled("moe_tiny"), fit)
    fitted = (names or (*FITTED, *ROLLED_FITTED, *PAIR_FITTED, *MOE_FITTED)) if refit else ()
    result = {"constants": fit, "fitted": list(fitted), "left_out": list(STALE)}
    for grid in (*GRIDS, *MOE_GRIDS, *PIPELINE_GRIDS, *WIDE_GRIDS):
        result[f"{grid}_points_planned"] = len(points(grid))
    table = []
    grids = [("training", train), ("training_large", large), ("held_out", held)]
    unseen = ("held_out_large", "held_out_vocab", *MOE_GRIDS, *PIPELINE_GRIDS, *WIDE_GRIDS)
    grids += [(g, compiled(g)) for g in unseen if not args.tiny]
    for grid, rows in grids:
        ests = estimates(rows, fit)
        err = errors(rows, ests)
        result[grid] = {
            "errors": err,
            "points": [
                {
                    "point": key(p),
                    "compiled_total": c["memory"]["total"],
                    "estimated_total": e.total,
                    "compiled_temp": c["memory"]["temp"],
                    "estimated_temp": e.temp,
                    "compiled_wire": sum(c["wire"].values()),
                    "estimated_wire": e.wire_bytes,
                    "ratio": round(e.total / c["memory"]["total"], 4),
                }
                for (p, c), e in zip(rows, ests, strict=True)
            ],
        }
        for fam, f in sorted(err.items()):
            table.append(
                [
                    grid,
                    fam,
                    f["points"],
                    f"{f['within_10pct']:.0%}",
                    f"{f['worst']:+.0%}",
                    f["worst_point"],
                    "–" if f["wire_within_5pct"] is None else f"{f['wire_within_5pct']:.0%}",
                ]
            )
    secs = [e.seconds for e in estimates(held[:20], fit)]
    result["estimate_ms_median"] = round(1e3 * sorted(secs)[len(secs) // 2], 3) if secs else None
    emit(
        "estimator",
        __doc__.splitlines()[0],
        ["grid", "recipes", "points", "within ±10 %", "worst", "worst point", "wire ±5 %"],
        table,
        args.out,
        result,
    )
    if refit:
        print("fitted constants:", fit)


if __name__ == "__main__":
    main()
