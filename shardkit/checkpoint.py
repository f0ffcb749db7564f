"""Checkpoints that restore into any layout: save under one plan, restore under another.

A checkpoint is one step directory written by orbax's ``CheckpointManager``: every
state leaf as a tensorstore array (each process writes its own shards), plus a small
JSON manifest with the leaf names, shapes, dtypes, a layout-independent checksum of
each leaf, the step and a ``data_state`` (where the data stream is). Saves are
asynchronous (training goes on while the files are written) and atomic: a step
directory appears only once complete, so a save interrupted by a crash leaves the
previous checkpoint as it was. The last ``keep`` checkpoints are kept, and with
``keep_best`` also the best ones by a metric.

Restoring takes ``like``, the state as it should come back: arrays or
``ShapeDtypeStruct``\\ s whose ``.sharding`` is the wanted layout (what
``plan.abstract_init`` returns). Each device reads only the part of each array its
shard covers, so a checkpoint saved under ``fsdp`` on 8 devices restores under ``tp``
on 4, or ``dp`` on 2, bit for bit. Leaves whose names, shapes or dtypes differ from
the checkpoint, and values that fail their checksum, raise a ``CheckpointError``
naming the leaf: nothing is restored partially, and nothing is unpickled.

Example:
  >>> import tempfile, jax, numpy as np, shardkit as sk
  >>> from shardkit import checkpoint, train
  >>> from shardkit.models import get
  >>> model, tx = get("gpt-tiny"), train.adamw()
  >>> init = train.init_fn(model, tx)
  >>> fsdp = sk.Plan("fsdp")                                  # 8 devices
  >>> state = fsdp.init(init, jax.random.key(0))
  >>> path = tempfile.mkdtemp()
  >>> checkpoint.save(fsdp, path, state, step=10, data_state={"next_batch": 10})
  >>> tp = sk.Plan("tp", devices=jax.devices()[:4])           # another layout
  >>> restored = checkpoint.restore(tp, path, like=tp.abstract_init(init, jax.random.key(0)))
  >>> restored.step, restored.data_state
  (10, {'next_batch': 10})
  >>> restored.state.params["wte"]["embedding"].sharding.spec
  P('tensor', None)
  >>> a, b = state.params["wte"]["embedding"], restored.state.params["wte"]["embedding"]
  >>> bool(np.array_equal(np.asarray(a), np.asarray(b)))
  True
"""

from __future__ import annotations

import atexit
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Sharding
from orbax.checkpoint.checkpoint_managers import preservation_policy as pp

from shardkit import distributed
from shardkit.dtypes import dtype_name
from shardkit.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ShardingError,
)
from shardkit.state import AbstractState

__all__ = ["Restored", "save", "restore", "wait", "steps", "manifest", "leaf_paths"]

_STATE, _MANIFEST = "state", "shardkit"
_FORMAT = 1
_SHOW = 5  # offending leaves named in one message


class Restored(NamedTuple):
    """What ``restore`` returns: the state in the new layout and what was saved with it."""

    state: Any
    step: int
    data_state: Any
    metrics: dict[str, float] | None


# -- leaf names ---------------------------------------------------------------------------
def leaf_paths(tree: Any) -> list[str]:
    """``'/'``-joined key paths of ``tree``'s leaves, in ``jax.tree.leaves`` order.

    Example:
      >>> leaf_paths({"params": {"w": 1, "b": 2}, "step": 0})
      ['params/b', 'params/w', 'step']
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]


def _flat(tree: Any) -> dict[str, Any]:
    names = leaf_paths(tree)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CheckpointError(f"Leaves {dup[:_SHOW]} have the same name; cannot checkpoint them.")
    return dict(zip(names, jax.tree.leaves(tree), strict=True))


# -- checksums: one uint32 per leaf, the same for every layout ---------------------------
def _leaf_checksum(x: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width)
        if x.dtype.itemsize == 8:  # bitcast to uint32 adds a trailing dimension of 2
            bits = bits[..., 0] ^ (bits[..., 1] * jnp.uint32(0x9E3779B1))
        bits = bits.astype(jnp.uint32)
    # Weight each element by its global position (wrapping uint32 arithmetic is exact and
    # order-free, so any sharding gives the same sum); a swap of two elements changes it.
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(bits.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, d)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= bits.shape[d]
    return jnp.sum(bits * (index * jnp.uint32(2654435761) + jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _checksums_jit(leaves: list[jax.Array]) -> jax.Array:
    if not leaves:
        return jnp.zeros((0,), jnp.uint32)
    return jnp.stack([_leaf_checksum(x) for x in leaves])


def _checksums(leaves: list[jax.Array]) -> list[int]:
    """One checksum per leaf; one computation per set of devices the leaves live on."""
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(tuple(sorted(d.id for d in x.sharding.device_set)), []).append(i)
    sums = [0] * len(leaves)
    for indices in groups.values():
        out = _checksums_jit([leaves[i] for i in indices])
        for i, v in zip(indices, np.asarray(out.addressable_data(0)), strict=True):
            sums[i] = int(v)
    return sums


# -- managers: one per directory, kept so async saves can finish -------------------------
_managers: dict[str, tuple[tuple, Any]] = {}


def _manager(path: str, *, keep: int | None, keep_best: int, best_metric: str, best_mode: str):

    key = os.path.abspath(os.fspath(path))
    options_key = (keep, keep_best, best_metric, best_mode)
    cached = _managers.get(key)
    if cached is not None and cached[0] == options_key:
        return cached[1]
    if cached is not None:
        cached[1].wait_until_finished()
        cached[1].close()
    policies: list = [pp.LatestN(keep)]
    if keep_best:
        policies.append(
            pp.BestN(
                get_metric_fn=lambda m: float(m[best_metric]),
                reverse=best_mode == "min",  # BestN keeps the end of the sorted list
                n=keep_best,
            )
        )
    options = ocp.CheckpointManagerOptions(
        preservation_policy=pp.AnyPreservationPolicy(policies),
        enable_async_checkpointing=True,
    )
    manager = ocp.CheckpointManager(key, options=options, item_names=(_STATE, _MANIFEST))
    _managers[key] = (options_key, manager)
    return manager


def _reader(path: str):
    """The directory's manager (after its pending saves commit), refreshed from disk."""
    key = os.path.abspath(os.fspath(path))
    if key not in _managers and not os.path.isdir(key):
        raise CheckpointNotFoundError(
            f"No checkpoint directory {path!r}.\nFix: pass the directory given to save()."
        )
    if key in _managers:
        manager = _managers[key][1]
    else:  # reading deletes nothing; a later save() with other options replaces it
        manager = _manager(key, keep=3, keep_best=0, best_metric="loss", best_mode="min")
    manager.wait_until_finished()
    manager.reload()
    return manager


def wait(path: str | os.PathLike | None = None) -> None:
    """Block until the asynchronous saves to ``path`` (default: every path) are committed."""
    keys = [os.path.abspath(os.fspath(path))] if path is not None else list(_managers)
    for key in keys:
        if key in _managers:
            _managers[key][1].wait_until_finished()


atexit.register(wait)


def steps(path: str | os.PathLike) -> list[int]:
    """The steps with a complete checkpoint under ``path``, ascending (``[]`` if none)."""
    if not os.path.isdir(path) and os.path.abspath(os.fspath(path)) not in _managers:
        return []
    return sorted(_reader(os.fspath(path)).all_steps())


def manifest(path: str | os.PathLike, step: int) -> dict[str, Any]:
    """What checkpoint ``step`` holds: leaves (name, shape, dtype, checksum), the step,
    ``data_state``, ``metrics``, and the recipe and mesh that saved it."""

    reader = _reader(os.fspath(path))
    try:
        return reader.restore(step, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()}))[
            _MANIFEST
        ]
    except Exception as e:  # orbax raises many kinds; all mean the same here
        raise CheckpointCorruptError(
            f"{path}/{step}: the shardkit manifest is missing or unreadable "
            f"({type(e).__name__}: {_first_line(e)}). Not a checkpoint shardkit wrote, or "
            f"a damaged one.\nFix: restore another step (steps: {steps(path)})."
        ) from None


# -- save -----------------------------------------------------------------------------------
def save(
    plan: Any,
    path: str | os.PathLike,
    state: Any,
    *,
    step: int,
    data_state: Any = None,
    metrics: Mapping[str, float] | None = None,
    keep: int | None = 3,
    keep_best: int = 0,
    best_metric: str = "loss",
    best_mode: str = "min",
    block: bool = False,
) -> None:
    """Save ``state`` as checkpoint ``step`` under ``path`` (every process calls it).

    Args:
      plan: the plan the state lives under (its recipe and mesh go into the manifest).
      path: the checkpoint directory; one subdirectory per step.
      state: a tree of ``jax.Array``\\ s (any container ``jax.tree`` flattens).
      step: the step number this checkpoint resumes from.
      data_state: JSON-serializable position of the data stream (and anything else a
        resumed run needs, e.g. a seed), returned by ``restore``.
      metrics: ``{name: float}`` stored with the step; ``keep_best`` ranks by one.
      keep: keep the ``keep`` most recent checkpoints (``None``: all).
      keep_best: also keep the ``keep_best`` best by ``metrics[best_metric]``
        (``best_mode`` ``"min"`` or ``"max"``).
      block: wait until the checkpoint is committed; by default the files are
        written in the background and the next ``save``/``restore``/``wait`` (or the
        process's exit) waits for them.

    Raises:
      CheckpointError: bad arguments, a leaf that is not an array, or a
        ``data_state`` that JSON cannot hold.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise CheckpointError(f"save(step={step!r}): the step must be a non-negative integer.")
    if best_mode not in ("min", "max"):
        raise CheckpointError(f"save(best_mode={best_mode!r}): use 'min' or 'max'.")
    if keep_best and (metrics is None or best_metric not in metrics):
        raise CheckpointError(
            f"save(keep_best={keep_best}) ranks checkpoints by metrics[{best_metric!r}], "
            f"but metrics={metrics!r}.\nFix: pass metrics={{{best_metric!r}: value}}."
        )
    flat = _flat(state)
    for name, x in flat.items():
        if not isinstance(x, jax.Array):
            raise CheckpointError(
                f"{name}: a {type(x).__name__}, not a jax.Array; checkpoints hold arrays.\n"
                "Fix: save the state plan.init made (or jnp.asarray the leaf)."
            )
    contents = {
        "format": _FORMAT,
        "step": int(step),
        "recipe": plan.recipe.name,
        "mesh": {k: int(v) for k, v in plan.mesh.shape.items()},
        "data_state": data_state,
        "metrics": None if metrics is None else {k: float(v) for k, v in metrics.items()},
        "leaves": [
            {"path": name, "shape": list(x.shape), "dtype": str(x.dtype), "checksum": c}
            for (name, x), c in zip(flat.items(), _checksums(list(flat.values())), strict=True)
        ],
    }
    try:
        json.dumps(contents)
    except TypeError as e:
        raise CheckpointError(
            f"save(data_state=...): JSON cannot hold it ({e}).\n"
            "Fix: pass numbers, strings, lists and dicts (e.g. {'next_batch': 120, 'seed': 0})."
        ) from None

    manager = _manager(
        os.fspath(path),
        keep=keep,
        keep_best=keep_best,
        best_metric=best_metric,
        best_mode=best_mode,
    )
    if int(step) in manager.all_steps():
        raise CheckpointError(
            f"{path} already holds a checkpoint for step {step}.\n"
            "Fix: save under a new step number, or into another directory."
        )
    manager.save(
        int(step),
        args=ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(flat), _MANIFEST: ocp.args.JsonSave(contents)}
        ),
        metrics=contents["metrics"],
        force=True,
    )
    distributed.note_checkpoint(os.fspath(path))
    if block:
        manager.wait_until_finished()


# -- restore ----------------------------------------------------------------------------------
def restore(plan: Any, path: str | os.PathLike, *, like: Any, step: int | None = None) -> Restored:
    """Restore checkpoint ``step`` (default: the latest complete one) in ``like``'s layout.

    Args:
      plan: the plan the state will live under; leaves of ``like`` without a
        sharding get the plan's.
      path: the directory ``save`` wrote.
      like: the state's structure, shapes, dtypes and shardings: an ``AbstractState``
        planned on ``plan``'s mesh (``plan.abstract_init(init_fn, rng)``), a tree of
        arrays or ``ShapeDtypeStruct``\\ s, or an object whose ``.tree`` holds one.
      step: which checkpoint; ``None`` for the latest.

    Returns:
      ``Restored(state, step, data_state, metrics)``; ``state`` has ``like``'s
      tree structure and shardings.

    Raises:
      CheckpointNotFoundError: no (such) complete checkpoint under ``path``.
      CheckpointMismatchError: leaves missing, extra, or of another shape or dtype,
        each named.
      CheckpointCorruptError: unreadable files or a leaf failing its checksum, named.
    """

    if isinstance(like, AbstractState) and like.mesh != plan.mesh:
        raise ShardingError(
            f"checkpoint.restore(plan, ..., like=...): like was planned on mesh "
            f"{dict(like.mesh.shape)}, not on the plan's {dict(plan.mesh.shape)}.\nFix: "
            "like=plan.abstract_init(init_fn, key) with the plan the state will live under."
        )
    tree = getattr(like, "tree", like)
    path = os.fspath(path)
    manager = _reader(path)
    available = sorted(manager.all_steps())
    if not available:
        raise CheckpointNotFoundError(
            f"No complete checkpoint under {path!r}.\n"
            "Fix: check the path, or start without restoring (a save interrupted before "
            "it committed leaves no step behind)."
        )
    if step is None:
        step = available[-1]
    elif step not in available:
        raise CheckpointNotFoundError(
            f"No complete checkpoint for step {step} under {path!r}; steps: {available}."
        )
    saved = manifest(path, step)
    if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
        raise CheckpointCorruptError(
            f"{path}/{step}: the manifest is not shardkit checkpoint format {_FORMAT}."
        )
    target = _targets(plan, tree)
    _check_leaves(path, step, saved["leaves"], target)
    try:
        restored = manager.restore(
            step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)})
        )[_STATE]
    except Exception as e:
        bad = _find_unreadable_leaf(path, step, target)
        where = f"leaf {bad!r}" if bad else "a leaf"
        raise CheckpointCorruptError(
            f"{path}/{step}: {where} cannot be read ({type(e).__name__}: {_first_line(e)}).\n"
            f"Fix: restore an earlier step (steps: {available})."
        ) from None
    names = list(target)
    sums = _checksums([restored[n] for n in names])
    for entry, got in zip(saved["leaves"], sums, strict=True):
        if entry["checksum"] != got:
            raise CheckpointCorruptError(
                f"{path}/{step}: leaf {entry['path']!r} {tuple(entry['shape'])} "
                f"{entry['dtype']} does not match its checksum (saved {entry['checksum']}, "
                f"read {got}): the files were changed after the save.\n"
                f"Fix: restore an earlier step (steps: {available})."
            )
    state = jax.tree.unflatten(jax.tree.structure(tree), [restored[n] for n in names])
    return Restored(state, int(step), saved.get("data_state"), saved.get("metrics"))


def _targets(plan: Any, tree: Any) -> dict[str, jax.ShapeDtypeStruct]:
    flat = _flat(tree)
    missing = [n for n, x in flat.items() if not isinstance(getattr(x, "sharding", None), Sharding)]
    planned = {}
    if missing:  # leaves of `like` without a layout take the plan's
        shardings = jax.tree.leaves(plan.shardings(tree), is_leaf=lambda s: isinstance(s, Sharding))
        planned = dict(zip(flat, shardings, strict=True))
    out = {}
    for name, x in flat.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise CheckpointError(
                f"restore(like=...): leaf {name} is a {type(x).__name__}, not an array or "
                "ShapeDtypeStruct.\nFix: pass plan.abstract_init(init_fn, rng)."
            )
        sharding = planned.get(name) or x.sharding
        out[name] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return out


def _check_leaves(path: str, step: int, saved: list[dict], target: dict) -> None:
    saved_by_name = {e["path"]: e for e in saved}
    missing = [n for n in target if n not in saved_by_name]
    extra = [n for n in saved_by_name if n not in target]
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} leaf(s) of `like` are not in the checkpoint: "
            + ", ".join(missing[:_SHOW])
            + (" ..." if len(missing) > _SHOW else "")
        )
    if extra:
        problems.append(
            f"{len(extra)} leaf(s) of the checkpoint are not in `like`: "
            + ", ".join(extra[:_SHOW])
            + (" ..." if len(extra) > _SHOW else "")
        )
    differ = []
    for name, x in target.items():
        e = saved_by_name.get(name)
        if e is None:
            continue
        if tuple(e["shape"]) != tuple(x.shape) or e["dtype"] != dtype_name(x.dtype):
            differ.append(
                f"{name}: checkpoint {tuple(e['shape'])} {e['dtype']}, "
                f"like {tuple(x.shape)} {dtype_name(x.dtype)}"
            )
    if differ:
        problems.append(
            f"{len(differ)} leaf(s) differ: "
            + "; ".join(differ[:_SHOW])
            + (" ..." if len(differ) > _SHOW else "")
        )
    if problems:
        raise CheckpointMismatchError(
            f"{path}/{step} does not hold this state: " + ". ".join(problems) + ".\n"
            "Fix: build `like` from the same model and optimizer that saved it "
            "(plan.abstract_init(init_fn, rng)), or restore into the saved model."
        )
    if [e["path"] for e in saved] != list(target):
        raise CheckpointMismatchError(
            f"{path}/{step}: the leaves are the same but in another order than `like`'s.\n"
            "Fix: build `like` with the same containers that saved it."
        )


def _find_unreadable_leaf(path: str, step: int, target: dict) -> str | None:
    """The first leaf that fails to restore alone (error path only)."""

    directory = os.path.join(os.path.abspath(path), str(step), _STATE)
    for name, x in target.items():
        try:
            with ocp.PyTreeCheckpointer() as reader:
                reader.restore(
                    directory,
                    args=ocp.args.PyTreeRestore(
                        {name: x},
                        restore_args={name: ocp.ArrayRestoreArgs(sharding=x.sharding)},
                        partial_restore=True,
                    ),
                )
        except Exception:
            return name
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
