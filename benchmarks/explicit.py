"""Explicit axes against Auto axes, compile only: every recipe's memory and wire bytes.

For each recipe and model the same training step (AdamW; pipeline recipes: the 1f1b
pipeline step) is compiled twice, on the same devices, once on an Auto mesh and once on
an Explicit one (``sk.Plan(recipe, explicit=True)``), and XLA's compiled program is read:
memory per device (arguments + output + temp − alias) and wire bytes of all collectives
(``parse_collectives``). The table gives the Explicit/Auto ratios, and whether the two
compiled steps take and return the same shardings. Nothing is allocated.

Run: python benchmarks/explicit.py [--tiny] [--layers N] [--recipes fsdp,tp]
"""

from __future__ import annotations

import os
import sys

from bench_util import MIB, emit, parser

#: (devices, microbatches) where not (8, none): pp on 4 devices splits 12 layers in 4;
#: dp_pp and zeropp have 4 devices on the batch (2 rows each: 2 micro-batches); tp and
#: tp_sp on 4, as 12 heads do not split over 8 devices.
DEVICES = {"pp": (4, 4), "dp_pp": (8, 2), "zeropp": (8, 2), "tp": (4, None), "tp_sp": (4, None)}


def measure(
    recipe: str, model_name: str, explicit: bool, *, batch: int, seq: int, layers: int | None
) -> dict:
    import jax

    import shardkit as sk
    from shardkit import models, train
    from shardkit.report.hlo import parse_collectives, wire_bytes_by_kind
    from shardkit.train import token_batch

    overrides = {} if layers is None else {"n_layers": layers}
    model = models.get(model_name, **overrides)
    devices, microbatches = DEVICES.get(recipe, (8, None))
    plan = sk.Plan(recipe, devices=jax.devices()[:devices], explicit=explicit)
    tx = train.adamw()
    abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
    if microbatches is None:
        step = train.train_step(model, tx)
    else:
        pipeline = {"microbatches": microbatches}
        step = train.train_step(model, tx, plan=plan, abstract=abstract, pipeline=pipeline)
    compiled = plan.jit(step, state=abstract).lower(abstract, token_batch(batch, seq)).compile()
    ma = compiled.memory_analysis()
    total = (
        ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        + ma.temp_size_in_bytes
        - ma.alias_size_in_bytes
    )
    wire = sum(wire_bytes_by_kind(parse_collectives(compiled.as_text())).values())
    return {
        "total": total,
        "wire": wire,
        "mesh": dict(plan.mesh.shape),
        "in": compiled.input_shardings,
        "out": compiled.output_shardings,
    }


def _spec(sharding) -> tuple:
    """A spec without its trailing ``None``s: XLA writes ``P('fsdp', None)`` as ``P('fsdp',)``."""
    spec = tuple(sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def tied_table_wire(
    explicit: bool, vocab: int = 50304, d: int = 768, batch: int = 8, seq: int = 256
) -> dict:
    """Wire bytes of the gradient of a tied table (lookup + logits) under dp on 8 devices,
    read through ``sk.per_replica``, typed by hand (no ``auto_axes``) under Explicit axes."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    import shardkit as sk
    from shardkit import context
    from shardkit.report.hlo import parse_collectives, wire_bytes_by_kind

    rules = sk.Rules([("batch", "data")])

    def lookup(t, ids):
        if not explicit:
            return jnp.take(t, ids, axis=0)
        spec = rules.spec(
            ("batch", "length", "embed"), shape=(*ids.shape, d), mesh=context.active_mesh()
        )
        return t.at[ids].get(out_sharding=spec)

    def loss(table, ids):
        view = sk.per_replica(table, ("vocab", "embed"), data=ids, data_axes=("batch", "length"))
        x = view.map(lookup, ids)
        return view.map(lambda t, h: jnp.einsum("bsd,vd->bsv", h, t), x).mean()

    mesh = sk.make_mesh({"data": 8}, explicit=explicit)
    with jax.set_mesh(mesh), context.using(param_rules=rules, activation_rules=rules):
        shardings = (
            NamedSharding(mesh, PartitionSpec()),
            NamedSharding(mesh, PartitionSpec("data")),
        )
        args = (
            jax.ShapeDtypeStruct((vocab, d), jnp.float32),
            jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        )
        compiled = jax.jit(jax.grad(loss), in_shardings=shardings).lower(*args).compile()
    return wire_bytes_by_kind(parse_collectives(compiled.as_text()))


def same_shardings(a, b) -> bool:
    """The same spec on the same devices, axis names and sizes (the axis types differ)."""
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.mesh.shape_tuple == y.mesh.shape_tuple
        and list(x.mesh.devices.flat) == list(y.mesh.devices.flat)
        and _spec(x) == _spec(y)
        for x, y in zip(la, lb, strict=True)
    )


def ratio(a: float, b: float) -> float:
    return 1.0 if a == b else (a / b if b else float("inf"))


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="override the layer count")
    p.add_argument("--recipes", default=None, help="comma-separated recipes (default: all)")
    p.add_argument("--models", default=None, help="comma-separated models")
    p.add_argument(
        "--per-replica",
        action="store_true",
        help="only the tied-table gradient under per_replica, Auto vs Explicit types",
    )
    args = p.parse_args(argv)
    import shardkit as sk

    sk.emulate_devices(8)
    if args.per_replica:
        rows = []
        for mode in (False, True):
            wire = tied_table_wire(mode)
            rows.append(
                [
                    "Explicit, typed" if mode else "Auto",
                    sk.per_replica.__name__,
                    *(wire.get(k, 0.0) * MIB for k in ("all-reduce", "all-gather")),
                ]
            )
        title = "A tied 50304 × 768 table's gradient under dp on 8 devices (compile only)"
        emit(
            "explicit_per_replica",
            title,
            ["axes", "read through", "all-reduce MiB", "all-gather MiB"],
            rows,
            args.out,
        )
        return
    # --tiny: a smoke run (gpt-tiny, one recipe).
    names = (
        args.models.split(",")
        if args.models
        else (["gpt-tiny"] if args.tiny else ["gpt-small", "llama-small"])
    )
    batch, seq = (8, 32) if args.tiny else (8, 256)
    recipes = (
        args.recipes.split(",")
        if args.recipes
        else (["zero1"] if args.tiny else sk.recipes.names())
    )
    headers = [
        "model",
        "recipe",
        "mesh",
        "Auto MiB/device",
        "Explicit MiB/device",
        "memory E/A",
        "Auto wire MiB",
        "Explicit wire MiB",
        "wire E/A",
        "same in/out shardings",
    ]
    rows = []
    for name in names:
        for recipe in recipes:
            kw = dict(batch=batch, seq=seq, layers=args.layers)
            try:
                a = measure(recipe, name, False, **kw)
                e = measure(recipe, name, True, **kw)
            except Exception as err:  # noqa: BLE001 (a row that says why)
                rows.append([name, recipe, "—", f"{type(err).__name__}: {err}"[:160], *["—"] * 6])
                print(rows[-1], file=sys.stderr, flush=True)
                continue
            same = same_shardings(a["in"], e["in"]) and same_shardings(a["out"], e["out"])
            mesh = "×".join(f"{k}={v}" for k, v in a["mesh"].items())
            rows.append(
                [
                    name,
                    recipe,
                    mesh,
                    a["total"] * MIB,
                    e["total"] * MIB,
                    ratio(e["total"], a["total"]),
                    a["wire"] * MIB,
                    e["wire"] * MIB,
                    ratio(e["wire"], a["wire"]),
                    "yes" if same else "NO",
                ]
            )
            print(rows[-1], flush=True)
            title = "Explicit axes against Auto axes (compile only), batch "
            title += f"{batch} × {seq} tokens" + (f", {args.layers} layers" if args.layers else "")
            emit("explicit", title, headers, rows, args.out)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(sys.argv[1:])
