"""``shardkit run``: train a model under a recipe, with progress and a summary."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from shardkit.cli import preflight
from shardkit.cli.devices_arg import add_devices_argument, select_devices
from shardkit.cli.fixes import FlagError
from shardkit.cli.model_arg import MODEL_HELP
from shardkit.cli.options import (
    add_attention,
    add_explicit,
    add_json,
    add_mesh,
    add_precision,
    emit_json,
    recipe_for,
    wants_tables,
)
from shardkit.cli.progress import MODES, StepProgress
from shardkit.errors import ShardingError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="train a model under a recipe")
    p.add_argument("--model", default="gpt-tiny", help=MODEL_HELP)
    p.add_argument("--recipe", default="fsdp", help="sharding recipe (default: fsdp)")
    add_devices_argument(p)
    add_mesh(p)
    add_attention(p)
    add_explicit(p)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--seq", type=int, default=128, help="sequence length")
    p.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--packed",
        action="store_true",
        help="train on packed rows: documents of log-normal length (--doc-length), each "
        "with its segment id and positions, attention and loss masked per document",
    )
    p.add_argument(
        "--doc-length",
        metavar="MU,SIGMA",
        type=_lognormal,
        default=None,
        help="--packed: document lengths exp(N(MU, SIGMA^2)) tokens (default: median "
        "seq/8, sigma 1.0)",
    )
    p.add_argument(
        "--no-balance",
        action="store_true",
        help="--packed: keep the contiguous context-parallel split (default: balance the "
        "attention work over the context ranks)",
    )
    add_precision(p)
    add_json(p)
    p.add_argument(
        "--progress",
        choices=MODES,
        default="auto",
        help="a bar on a terminal, log lines (step, loss, tokens/s, ETA) otherwise (auto, "
        "the default); bar, log or none to choose",
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=None,
        metavar="N",
        help="log lines: one every N steps (default: about 20 lines per run)",
    )
    p.add_argument(
        "--log-seconds",
        type=float,
        default=30.0,
        metavar="S",
        help="log lines: also one whenever S seconds passed since the last (default: 30)",
    )
    p.add_argument(
        "--no-report",
        action="store_true",
        help="skip the layout report (memory, collectives vs analytic) after the run",
    )
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="save the state and data position to DIR after the last step",
    )
    p.add_argument("--save-every", type=int, metavar="K", help="also save every K steps")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir (--steps counts all steps)",
    )
    p.add_argument(
        "--dcn",
        metavar="AXIS=N",
        action="append",
        default=[],
        type=_dcn_item,
        help="multi-process runs: lay N processes along mesh axis AXIS (repeatable)",
    )
    from shardkit.parallel.cli import add_arguments

    add_arguments(p)  # --microbatches --schedule --virtual-stages --unit
    p.set_defaults(handler=main, check=check)


def _validate(args: argparse.Namespace):
    for flag in ("steps", "batch", "seq"):
        if getattr(args, flag) < 1:
            raise FlagError(
                f"--{flag} must be at least 1, got {getattr(args, flag)}.",
                [{f"--{flag}": "1"}, {f"--{flag}": None}],
            )
    if args.log_every is not None and args.log_every < 1:
        raise FlagError(
            f"--log-every must be at least 1, got {args.log_every}.", [{"--log-every": None}]
        )
    if args.save_every is not None and args.save_every < 1:
        raise FlagError(
            f"--save-every must be at least 1, got {args.save_every}.", [{"--save-every": None}]
        )
    if (args.doc_length is not None or args.no_balance) and not args.packed:
        flag = "--doc-length" if args.doc_length is not None else "--no-balance"
        raise FlagError(f"{flag} is for packed rows.", [{"--packed": ""}, {flag: None}])
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        flag = "--resume" if args.resume else "--save-every"
        raise FlagError(
            f"{flag} needs --checkpoint-dir DIR.",
            [{"--checkpoint-dir": "checkpoints"}] if not args.resume else [{"--resume": None}],
        )
    return preflight.prepare(args)


def check(args: argparse.Namespace) -> None:
    """``shardkit run``'s flags, and the layout (``preflight.check``)."""
    _validate(args)
    preflight.check(args)


def main(args: argparse.Namespace) -> int:
    model = _validate(args)
    from shardkit.cli.launch_cmd import join_launched_run

    devices = join_launched_run(args.devices) or select_devices(args.devices)
    from shardkit.plan import Plan  # imports JAX-heavy modules only once devices are set
    from shardkit.run import run

    if args.dcn:
        recipe = recipe_for(args.recipe, args)
        plan = Plan(
            recipe,
            mesh=_mesh(args, recipe, devices),
            precision=args.precision,
            annotations=model.annotations,
        )
        plan.batch_sharding((args.batch, args.seq), path="--batch/--seq")
    else:  # the batch and pipeline flags checked before compiling
        plan = preflight.layout(args, args.recipe, model, devices)

    import jax

    main_process = jax.process_index() == 0  # reports and logs print once
    mode = args.progress if main_process else "none"  # the others quiet unless they fail
    with StepProgress(
        args.steps,
        f"{args.model} · {args.recipe}",
        first_step=_first_step(args),
        mode=mode,
        every=args.log_every,
        seconds=args.log_seconds,
    ) as progress:
        balance: dict[int, str] = {}

        def on_balance(step: int, trained: float, contiguous: float) -> None:
            balance[step] = f"attention work max/mean {trained:.3f} (contiguous {contiguous:.3f})"

        def on_step(step: int, loss: float, tps: float) -> None:
            progress.update(step, loss=loss, tokens_per_s=tps, note=balance.pop(step, ""))

        result = _run_or_stop_with_peers(
            run,
            model,
            plan,
            steps=args.steps,
            batch=args.batch,
            seq=args.seq,
            learning_rate=args.lr,
            seed=args.seed,
            on_step=on_step,
            checkpoint_dir=args.checkpoint_dir,
            resume=args.resume,
            save_every=args.save_every,
            pipeline=_pipeline_options(args),
            **_packing_options(args),
            on_balance=on_balance if args.packed else None,
        )
    if not main_process:
        return 0
    emit_json(args, result.to_json())
    if wants_tables(args):
        _print_summary(result)
        if not args.no_report:
            from shardkit.cli.render import print_report

            print_report(result.report, Console(), top=6)
    return 0


def _run_or_stop_with_peers(run, *args, **kwargs):
    """``run(...)``; a step that failed because a peer died waits for JAX's runtime to end
    this process (the distributed guard then prints one line naming the dead process)."""
    try:
        return run(*args, **kwargs)
    except ShardingError:
        raise
    except Exception:
        from shardkit import distributed

        distributed.wait_for_fatal_error()  # returns at once in a single-process run
        raise


def _first_step(args: argparse.Namespace) -> int:
    """The step a ``--resume`` run starts from (0 for a fresh run): the latest checkpoint."""
    if not args.resume:
        return 0
    from shardkit import checkpoint

    try:
        return max(checkpoint.steps(args.checkpoint_dir), default=0)
    except OSError:
        return 0


def _mesh(args: argparse.Namespace, recipe, devices):
    from shardkit.mesh import make_mesh

    dcn = dict(args.dcn)
    sizes = recipe.axis_sizes(len(devices))
    return make_mesh(sizes, devices=devices, dcn=dcn, explicit=args.explicit)


def _lognormal(text: str) -> tuple[float, float]:
    """``"4.0,1.0"`` → ``(4.0, 1.0)``: the log-normal's mu and sigma."""
    try:
        mu, sigma = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected MU,SIGMA, e.g. --doc-length 4.0,1.0"
        ) from None
    if sigma < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: SIGMA must be >= 0")
    return mu, sigma


def _packing_options(args: argparse.Namespace) -> dict:
    """``run``'s packing arguments from ``--packed``, ``--doc-length``, ``--no-balance``."""
    if not args.packed:
        return {}
    import math

    from shardkit.packing import LogNormal

    mu, sigma = args.doc_length or (math.log(max(args.seq / 8, 2)), 1.0)
    return {"packed": LogNormal(mu, sigma), "balance": not args.no_balance}


def _dcn_item(text: str) -> tuple[str, int]:
    """``"data=2"`` → ``("data", 2)``: processes laid along a mesh axis."""
    axis, _, size = text.partition("=")
    if not axis or not size.isdigit() or int(size) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected AXIS=N, e.g. --dcn data=2")
    return axis, int(size)


def _print_summary(result) -> None:
    mib = 1 / 2**20
    mem = result.memory_per_device_bytes
    table = Table(
        title=f"shardkit run: {result.model} under {result.recipe}",
        title_justify="left",
        show_header=False,
        box=None,
        pad_edge=False,
        padding=(0, 2, 0, 0),
    )
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    mesh = " × ".join(f"{a}={s}" for a, s in result.mesh.items())
    table.add_row("mesh", f"{mesh} ({result.devices} {result.platform} devices)")
    table.add_row(
        "memory / device",
        f"{mem['total'] * mib:,.2f} MiB: arguments {mem['arguments'] * mib:,.2f} + temp "
        f"{mem['temp'] * mib:,.2f} + output {mem['output'] * mib:,.2f} − alias "
        f"{mem['alias'] * mib:,.2f}",
    )
    first, last = result.losses[0], result.losses[-1]
    if result.first_step:
        table.add_row(
            "resumed",
            f"from step {result.first_step} (losses of steps {result.first_step}–"
            f"{result.first_step + len(result.losses) - 1})",
        )
    table.add_row("loss", f"{first:.4f} → {last:.4f} nats/token")
    table.add_row("entropy bound", f"{result.entropy_bound:.4f} nats/token (no model can beat it)")
    table.add_row("gap to bound", f"{last - result.entropy_bound:.4f} nats/token")
    if result.imbalance:
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        table.add_row(
            "attention balance",
            f"max/mean work over {result.context_ranks} context ranks {mean(result.imbalance):.3f}"
            f" (contiguous split {mean(result.imbalance_contiguous):.3f}), mean of "
            f"{len(result.imbalance)} steps",
        )
    table.add_row("throughput", f"{result.tokens_per_s:,.0f} tokens/s (after the compile step)")
    if result.router is not None:
        load = [sum(col) for col in zip(*result.router["load"], strict=True)]
        dropped = sum(map(sum, result.router["dropped"]))
        table.add_row(
            "dropped tokens",
            f"{dropped:,.0f} of {sum(load):,.0f} routed ({result.dropped_fraction:.2%}) on "
            "the last batch",
        )
        table.add_row("tokens per expert", ", ".join(f"{x:,.0f}" for x in load))
    Console().print(table)


def _pipeline_options(args: argparse.Namespace):
    from shardkit.parallel.cli import options

    return options(args)
