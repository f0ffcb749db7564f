"""Latent attention under tensor parallelism: the K/V latent per device, heads split vs
latent split, compiled.

Compile only (nothing runs), f32, deepseek-small (MLA with a 256-rank K/V latent and a
384-rank query latent, 16 heads, 16 fine-grained experts top-4 plus 2 shared), global
batch 8, seq 256, 8 devices. Per layout: the per-device bytes of every layer's K/V latent
``[layers, batch, seq, d_c]`` as the compiled program returns it
(:func:`shardkit.models.deepseek.latent_cache`, its output's size per device) against the
count ``L·b·s·d_c·4 / split`` (:func:`shardkit.report.analytic_mla.latent_bytes`: the
devices the rules split the latent's batch and rank over); and the training step's memory and wire bytes per device
(:func:`shardkit.report.build_report`). ``tp``: heads over ``tensor`` (8), the latent
replicated; ``tp_latent`` (``recipes.get("tp").with_latent("split")``): the latent split
over ``tensor``. ``ep_tp`` / ``ep_tp_latent``: the same on expert 4 × tensor 2.

Target (issue 29): with the latent split over ``tensor`` the latent per device is 1/t of
the replicated layout's.

Run: python benchmarks/mla.py [--tiny]  (--tiny: deepseek-tiny, seq 16, tp and tp_latent)
"""

from __future__ import annotations

import shardkit as sk

sk.emulate_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_util import MIB, emit, parser  # noqa: E402

from shardkit import models, recipes  # noqa: E402
from shardkit.models.deepseek import latent_cache  # noqa: E402
from shardkit.report import analytic_mla  # noqa: E402

LAYOUTS = ("tp", "tp_latent", "ep_tp", "ep_tp_latent")


def recipe_of(name: str) -> sk.Recipe:
    base = recipes.get(name.removesuffix("_latent"))
    return base.with_latent("split") if name.endswith("_latent") else base


def latent_bytes(plan: sk.Plan, model, batch: int, seq: int) -> int:
    """Per-device bytes of the compiled latent cache's output."""
    params = plan.abstract_init(model.init, jax.random.key(0)).tree
    shape = (batch, seq)
    tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=plan.batch_sharding(shape))
    with jax.set_mesh(plan.mesh), plan.context():
        lowered = jax.jit(lambda p, t: latent_cache(model, p, t)).lower(params, tokens)
    return lowered.compile().memory_analysis().output_size_in_bytes


def measure(name: str, layout: str, batch: int, seq: int) -> dict:
    model = models.get(name)
    plan = sk.Plan(recipe_of(layout))
    cache = latent_bytes(plan, model, batch, seq)
    mesh = dict(plan.mesh.shape)
    analytic = analytic_mla.latent_bytes(model.dims, plan.recipe, mesh, batch=batch, seq=seq)
    report = sk.report.build_report(plan, model=model, batch=batch, seq=seq)
    return {
        "layout": layout,
        "mesh": dict(plan.mesh.shape),
        "latent_bytes": cache,
        "latent_analytic_bytes": analytic,
        "memory_bytes": report.memory.total,
        "temp_bytes": report.memory.temp,
        "wire_bytes": report.wire_bytes,
        "wire_bytes_by_kind": dict(report.wire_bytes_by_kind),
    }


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    name, batch, seq = ("deepseek-tiny", 8, 16) if args.tiny else ("deepseek-small", 8, 256)
    layouts = LAYOUTS[:2] if args.tiny else LAYOUTS  # --tiny: one heads/latent pair
    results = {layout: measure(name, layout, batch, seq) for layout in layouts}
    rows = []
    for layout, m in results.items():
        base = results[layout.removesuffix("_latent")]["latent_bytes"]
        rows.append(
            [
                layout,
                " × ".join(f"{a} {n}" for a, n in m["mesh"].items()),
                m["latent_bytes"] * MIB,
                m["latent_bytes"] / m["latent_analytic_bytes"],
                base / m["latent_bytes"],
                m["temp_bytes"] * MIB,
                m["memory_bytes"] * MIB,
                m["wire_bytes"] * MIB,
            ]
        )
    checks = {
        f"{layout} latent = 1/{results[layout]['mesh']['tensor']} of "
        f"{layout.removesuffix('_latent')}'s": results[layout]["latent_bytes"]
        * results[layout]["mesh"]["tensor"]
        == results[layout.removesuffix("_latent")]["latent_bytes"]
        for layout in layouts
        if layout.endswith("_latent")
    }
    headers = [
        "layout",
        "mesh",
        "K/V latent MiB/dev",
        "÷ count",
        "heads layout ÷ this",
        "step temp MiB/dev",
        "step memory MiB/dev",
        "step wire MiB/dev",
    ]
    emit(
        "mla",
        f"Latent attention under TP: {name}, batch {batch}, seq {seq}, 8 devices (compile only)",
        headers,
        rows,
        args.out,
        extra={"results": results, "checks": checks},
    )
    print({k: "ok" if v else "MISSED" for k, v in checks.items()})


if __name__ == "__main__":
    main()
