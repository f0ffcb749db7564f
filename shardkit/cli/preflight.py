"""What ``run``, ``report``, ``compare`` and ``plan`` check before they compile anything.

:func:`prepare` reads the flags (output paths, the model, the recipes and ``--mesh``
axes, ``--seq``); :func:`layout` builds one recipe's plan on the devices and checks the
batch and the pipeline flags against its mesh. :func:`check` runs both and lays the
state out abstractly (every parameter against the mesh): a command line that passes it
gets as far as compiling. ``shardkit.cli.fixes`` runs it on every fix it prints.

Example:
  >>> from shardkit.cli import build_parser
  >>> check(build_parser().parse_args(["report", "--recipe", "tp", "--devices", "4"]))
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from shardkit.cli.devices_arg import select_devices
from shardkit.cli.fixes import PIPELINE_FLAGS, FlagError
from shardkit.cli.model_arg import default_seq, resolve_model
from shardkit.cli.options import check_outputs, recipe_for

__all__ = ["check", "layout", "prepare", "recipe_names"]


def recipe_names(args: argparse.Namespace) -> list[str]:
    """The recipes the command names: ``--recipe``, or ``compare``'s ``--recipes``."""
    if getattr(args, "recipes", None):
        return [r.strip() for r in args.recipes.split(",") if r.strip()]
    return [args.recipe] if getattr(args, "recipe", None) else []


def prepare(args: argparse.Namespace) -> Any:
    """Check the flags that need no devices; the model. Sets ``args.seq``'s default."""
    check_outputs(args)
    model = resolve_model(args.model, remat=getattr(args, "remat", None))
    names = recipe_names(args)
    for name in names:
        flag = "--recipes" if getattr(args, "recipes", None) else "--recipe"
        recipe_for(name, args, flag=flag, others=names)
    if hasattr(args, "seq"):
        args.seq = args.seq or default_seq(model)
        dims = model.dims
        if dims is not None and dims.position_table and args.seq > dims.max_seq:
            raise FlagError(
                f"--seq {args.seq}: {args.model} has {dims.max_seq} positions "
                "(its learned position table).",
                [{"--seq": str(dims.max_seq)}],
            )
    return model


def layout(args: argparse.Namespace, name: str, model: Any, devices: list) -> Any:
    """The plan of recipe ``name`` on ``devices``, its batch and pipeline flags checked.

    Sets ``args.batch``'s default (one example per device) where the command has one.
    """
    from shardkit.plan import Plan

    plan = Plan(
        recipe_for(name, args),
        devices=devices,
        explicit=getattr(args, "explicit", False),
        annotations=model.annotations,
        precision=getattr(args, "precision", "f32"),
    )
    if getattr(args, "batch", False) is None:
        args.batch = len(devices)
    if hasattr(args, "batch"):
        plan.batch_sharding((args.batch, args.seq), path="--batch/--seq")
        _check_attention(args, plan)
    _check_pipeline(args, name, model, plan)
    return plan


def _check_attention(args: argparse.Namespace, plan: Any) -> None:
    """Ring attention (and TSP's zigzag) cut each sequence into 2 chunks per device of
    the attention axis, all-gather attention into one: the sequence must split so."""
    recipe, mesh = plan.recipe, dict(plan.mesh.shape)
    sizes = [int(mesh.get(a, 1)) for a in recipe.context_axes]
    n = math.prod(sizes)
    if recipe.attention == "dense" or n == 1:
        return
    ring = sizes[-1] if recipe.attention in ("ring", "usp") else 1
    if getattr(recipe, "balance", "none") == "zigzag":  # 2 chunks per rank, any strategy
        ring = sizes[-1]
    chunks = math.lcm(n, 2 * ring) if ring > 1 else n
    if args.seq % chunks:
        raise FlagError(
            f"--seq {args.seq}: {recipe.attention} attention over {recipe.attention_axis!r} "
            f"(size {' × '.join(map(str, sizes))}) splits each sequence into {chunks} chunks.",
            [
                {"--seq": str(-(-args.seq // chunks) * chunks)},
                {"--seq": str(args.seq // chunks * chunks)},
            ],
        )


def _flag_given(args: argparse.Namespace, flag: str) -> bool:
    """Whether a pipeline flag is on the command line (``--rolled`` / ``--unrolled`` set
    one value, ``rolled``, each way)."""
    if flag in ("--rolled", "--unrolled"):
        return getattr(args, "rolled", None) is (flag == "--rolled")
    return bool(getattr(args, flag[2:].replace("-", "_"), None))


def _check_pipeline(args: argparse.Namespace, name: str, model: Any, plan: Any) -> None:
    """What the pipelined step checks while it is traced, checked before (as it does)."""
    from shardkit.errors import NotPipelinableError
    from shardkit.parallel.cli import options
    from shardkit.parallel.pipeline import spec_axes
    from shardkit.step import PIPELINE_DEFAULTS

    opts = options(args)
    mesh = {str(a): int(s) for a, s in plan.mesh.shape.items()}
    stages = mesh.get("stage")
    if stages is None:
        if opts is not None:
            raise NotPipelinableError(
                f"{' '.join(f for f in PIPELINE_FLAGS if _flag_given(args, f))}"
                f": recipe {name!r} has no 'stage' axis to pipeline over (mesh {mesh})."
            )
        return
    cut = model.stages()  # a model without a cut raises, naming how to give one
    layers = _stack_layers(model, cut)
    opts = opts or PIPELINE_DEFAULTS
    micro = opts.get("microbatches") or stages
    chunks = stages * opts["virtual_stages"]
    if layers % chunks:
        devices = math.prod(mesh.values())
        fewer = [d for d in range(stages - 1, 0, -1) if layers % d == 0]
        raise FlagError(
            f"{layers} layers of {args.model} do not split into {stages} stages"
            f" × {opts['virtual_stages']} virtual stages.",
            [
                {"--virtual-stages": None, "--schedule": "1f1b"},
                *({"--devices": str(devices // stages * d)} for d in fewer),
                *({"--mesh": f"stage={d}"} for d in fewer),
            ],
        )
    # the batch's axes, as the step splits it (sizes every axis divides: under TP+SP,
    # 'tensor' splits the length)
    spec = tuple(plan.batch_sharding((plan.mesh.size, plan.mesh.size)).spec)
    shards = math.prod(mesh[a] for a in (spec_axes(spec[0]) if spec else ()))
    batch = getattr(args, "batch", None)
    if batch and batch % (micro * shards):
        need = micro * shards
        raise FlagError(
            f"--batch {batch}: {micro} micro-batches on {shards} device(s) of the batch axes "
            f"need a batch that is a multiple of {need}.",
            [
                {"--batch": str(-(-batch // need) * need)},
                *(
                    {"--microbatches": str(m)}
                    for m in range(micro - 1, 0, -1)
                    if (batch // shards) % m == 0 and batch % shards == 0
                ),
            ],
        )


def check(args: argparse.Namespace) -> None:
    """Everything ``args``'s command checks before compiling, and the abstract layout.

    Raises:
      ShardingError: the first mistake found.
    """
    import jax

    from shardkit import train
    from shardkit.parallel.cli import for_plan, options

    model = prepare(args)
    devices = select_devices(getattr(args, "devices", None))
    tx = train.adamw()
    for name in recipe_names(args) if args.command != "compare" or args.recipes else []:
        plan = layout(args, name, model, devices)
        abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
        if "stage" in plan.mesh.shape:
            train.train_step(
                model, tx, plan=plan, abstract=abstract, pipeline=for_plan(plan, options(args))
            )


def _stack_layers(model: Any, cut: Any) -> int:
    """Layers of the stack a pipeline cuts: the declared ones, else the stack's leading axis."""
    if model.dims is not None:
        return model.dims.layers
    import jax

    from shardkit.annotate.unbox import unbox

    stack, _ = cut.split(unbox(jax.eval_shape(lambda: model.init(jax.random.key(0)))))
    return int(jax.tree.leaves(stack)[0].shape[0])
