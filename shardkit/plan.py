"""``sk.Plan``: the one object between a model and a compiled, sharded step.

A plan joins a recipe (logical → mesh rules) with a mesh. It turns any state
tree into ``NamedSharding``s, creates state directly sharded, jits a user's
``step(state, batch)`` with derived in/out shardings and donation, and places
host batches (process-local slices in multi-process runs).

Example:
  >>> import jax, jax.numpy as jnp, optax, shardkit as sk
  >>> from shardkit.models import get
  >>> model = get("gpt-tiny")
  >>> plan = sk.Plan("fsdp")                       # mesh sized from all devices
  >>> tx = optax.adamw(1e-3)
  >>> def init(rng):
  ...     params = model.init(rng)
  ...     return params, tx.init(sk.unbox(params))
  >>> params, opt_state = plan.init(init, jax.random.key(0))
  >>> params["wte"]["embedding"].sharding.spec
  P('fsdp', None)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.annotate.constrain import activation_rules, param_rules
from shardkit.annotate.flax_meta import is_annotated_leaf
from shardkit.annotate.logical import LeafInfo, describe_leaves
from shardkit.annotate.path_axes import PathAxes
from shardkit.annotate.patterns import PatternAxes
from shardkit.annotate.unbox import unbox
from shardkit.attention import use_attention
from shardkit.errors import ShardingError
from shardkit.mesh import make_mesh
from shardkit.recipes import Recipe
from shardkit.recipes import get as get_recipe
from shardkit.report.hlo import KINDS
from shardkit.rules import Rules

__all__ = ["Plan", "PlannedLeaf", "BATCH_AXES"]

#: Logical axes of batch arrays, by rank: examples, then sequence positions.
BATCH_AXES = ("batch", "length")


@dataclasses.dataclass(frozen=True)
class PlannedLeaf:
    """One leaf of a state tree with its logical axes and planned spec."""

    info: LeafInfo
    spec: PartitionSpec

    @property
    def path(self) -> str:
        return self.info.path


class Plan:
    """A recipe (or bare rules) on a mesh.

    Args:
      recipe: a recipe name (``"fsdp"``), a ``Recipe``, or ``Rules`` for
        parameters (activations then use the same rules).
      mesh: the mesh; default: the recipe's axes sized over ``devices``.
      devices: devices for the default mesh (default: all).
      annotations: a ``sk.PathAxes`` (or its list of ``(regex, logical_axes)`` pairs)
        for leaves Flax did not annotate.
      on_unmatched: policy for non-scalar leaves with no logical axes (default: the
        ``annotations``' own policy, else ``"replicate"``).
    """

    def __init__(
        self,
        recipe: str | Recipe | Rules,
        mesh: Mesh | None = None,
        *,
        devices: Sequence[jax.Device] | None = None,
        annotations: PathAxes | Sequence[tuple[str, Sequence[str | None]]] | None = None,
        on_unmatched: Literal["replicate", "error"] | None = None,
    ):
        if isinstance(recipe, (Rules, list, tuple)):
            if mesh is None:
                raise ShardingError(
                    "Plan(rules) needs a mesh: bare rules name no mesh axes to size.\n"
                    "Fix: sk.Plan(rules, sk.make_mesh({'fsdp': -1})), or pass a recipe name."
                )
            rules = Rules(recipe)
            recipe = Recipe(
                "custom", "custom rules", (), rules, rules, collectives=frozenset(KINDS)
            )
        self.recipe: Recipe = get_recipe(recipe) if isinstance(recipe, str) else recipe
        if mesh is None:
            devices = list(jax.devices() if devices is None else devices)
            mesh = make_mesh(self.recipe.axis_sizes(len(devices)), devices=devices)
        self.mesh = mesh
        if annotations is not None and not isinstance(annotations, PatternAxes):
            annotations = PathAxes(annotations)  # a plain list of (regex, axes) pairs
        self.annotations = annotations
        # A PathAxes carries its own policy; an explicit argument overrides it.
        default = getattr(annotations, "on_unmatched", "replicate")
        self.on_unmatched = on_unmatched or default
        for rules in (self.rules, self.activation_rules, self.recipe.optimizer_rules):
            if rules is not None:
                rules.validate(mesh)
        # Shardings of the state trees this plan created, by tree structure: state that
        # comes back as plain arrays (host copies, restored checkpoints) keeps its layout.
        self._planned: dict[Any, list[NamedSharding]] = {}

    # -- rules -------------------------------------------------------------------------
    @property
    def rules(self) -> Rules:
        return self.recipe.rules

    @property
    def activation_rules(self) -> Rules:
        return self.recipe.activation_rules

    def __repr__(self) -> str:
        return f"Plan({self.recipe.name!r}, mesh={dict(self.mesh.shape)})"

    # -- specs and shardings --------------------------------------------------------------
    def _rules_for(self, info: LeafInfo) -> Rules:
        if info.source == "mirror" and self.recipe.optimizer_rules is not None:
            return self.recipe.optimizer_rules
        return self.rules

    def leaves(self, tree: Any) -> list[PlannedLeaf]:
        """Every leaf of ``tree`` with its logical axes and ``PartitionSpec``."""
        infos, _ = describe_leaves(
            tree, annotations=self.annotations, on_unmatched=self.on_unmatched
        )
        flat = jax.tree.leaves(tree, is_leaf=is_annotated_leaf)
        return [PlannedLeaf(i, self._spec_of(x, i)) for x, i in zip(flat, infos, strict=True)]

    def _spec_of(self, leaf: Any, info: LeafInfo) -> PartitionSpec:
        existing = self._existing(leaf)
        if existing is not None:
            return existing.spec
        return self._rules_for(info).spec(info.axes, info.shape, self.mesh, info.path)

    def specs(self, tree: Any) -> Any:
        """A tree of ``PartitionSpec`` (Flax boxes / NNX Variables count as leaves)."""
        _, treedef = describe_leaves(tree, annotations=self.annotations, on_unmatched="replicate")
        return jax.tree_util.tree_unflatten(treedef, [leaf.spec for leaf in self.leaves(tree)])

    def shardings(self, tree: Any) -> Any:
        """A tree of ``NamedSharding`` for params, optimizer state, or both.

        Leaves that already carry a ``NamedSharding`` on this plan's mesh (arrays
        from ``plan.init``, ``ShapeDtypeStruct``s from ``plan.abstract_init``)
        keep it.
        """
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_annotated_leaf)
        if treedef in self._planned:
            return jax.tree_util.tree_unflatten(treedef, self._planned[treedef])
        planned = self.leaves(tree)
        return jax.tree_util.tree_unflatten(
            treedef,
            [
                self._existing(x) or NamedSharding(self.mesh, p.spec)
                for x, p in zip(leaves, planned, strict=True)
            ],
        )

    def _existing(self, x: Any) -> NamedSharding | None:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
            return sharding
        return None

    def batch_sharding(self, shape: Sequence[int], path: Any = "batch") -> NamedSharding:
        """Sharding of one batch array: ``batch`` then ``length`` by activation rules."""
        axes = (BATCH_AXES + (None,) * len(shape))[: len(shape)]
        spec = self.activation_rules.spec(axes, tuple(shape), self.mesh, path)
        return NamedSharding(self.mesh, spec)

    def batch_shardings(self, batch: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda p, x: self.batch_sharding(np.shape(x), ("batch", *p)), batch
        )

    # -- state ----------------------------------------------------------------------------
    def abstract_init(self, init_fn: Callable[..., Any], *args: Any) -> Any:
        """``init_fn``'s result as ``ShapeDtypeStruct``s carrying planned shardings.

        Nothing is allocated: use it to compile-only plan a model of any size.
        """
        with nnx.use_eager_sharding(False):
            return self._abstract_state(jax.eval_shape(init_fn, *args))

    def _abstract_state(self, abstract: Any) -> Any:
        """Unboxed ``ShapeDtypeStruct``s with planned shardings, from an annotated tree."""
        shardings = jax.tree.leaves(self.shardings(abstract))
        leaves, treedef = jax.tree.flatten(unbox(abstract))
        state = jax.tree.unflatten(
            treedef,
            [
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                for x, s in zip(leaves, shardings, strict=True)
            ],
        )
        return self._remember(state, shardings)

    def _remember(self, state: Any, shardings: list[NamedSharding]) -> Any:
        treedef = jax.tree_util.tree_structure(state, is_leaf=is_annotated_leaf)
        self._planned[treedef] = shardings
        return state

    def init(self, init_fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``init_fn(*args)`` with its outputs born sharded; returns plain arrays.

        ``init_fn`` returns params (boxed linen params or an NNX ``State``) and
        optionally optimizer state built from them, in any container. It runs
        under ``jit`` with ``out_shardings``, so no device ever holds the
        whole unsharded state.
        """
        with nnx.use_eager_sharding(False):
            abstract = jax.eval_shape(init_fn, *args)
            # Flat leaves in and out: NNX objects carry static fields (an optimizer's
            # ``tx``) that need not compare equal between two calls of ``init_fn``.
            shardings = jax.tree.leaves(self.shardings(abstract))
            structure = []

            def flat_init(*a):
                leaves, treedef = jax.tree.flatten(unbox(init_fn(*a)))
                structure.append(treedef)
                return leaves

            with jax.set_mesh(self.mesh):
                leaves = jax.jit(flat_init, out_shardings=shardings)(*args)
        return self._remember(jax.tree.unflatten(structure[-1], leaves), shardings)

    def shard_batch(self, host_batch: Any) -> Any:
        """Global batch arrays from host arrays.

        In a multi-process run each process passes only its rows (contiguous,
        ``global_batch // process_count`` each); the global shape is inferred.
        """
        processes = jax.process_count()

        def place(path, x):
            x = np.asarray(x)
            global_shape = (x.shape[0] * processes, *x.shape[1:]) if x.ndim else x.shape
            sharding = self.batch_sharding(global_shape, ("batch", *path))
            if processes == 1:
                return jax.device_put(x, sharding)
            return jax.make_array_from_process_local_data(sharding, x, global_shape)

        return jax.tree_util.tree_map_with_path(place, host_batch)

    # -- steps ----------------------------------------------------------------------------
    def jit(self, step_fn: Callable[..., Any], *, donate_state: bool = True) -> PlannedStep:
        """``step_fn(state, batch, ...)`` jitted with planned shardings.

        The returned step derives in/out shardings from the first call's
        arguments (state leaves keep the sharding ``plan.init`` gave them) and
        returns ``(new_state, *rest)`` with the state's sharding unchanged.
        """
        return PlannedStep(self, step_fn, donate_state)

    def lower(
        self,
        step_fn: Callable[..., Any],
        state: Any,
        batch: Any,
        *args: Any,
        donate_state: bool = True,
    ):
        """Lower ``step_fn`` for these (possibly abstract) arguments, as ``plan.jit`` would."""
        return self.jit(step_fn, donate_state=donate_state).lower(state, batch, *args)

    def report(self, compiled: Any, state: Any, **kwargs: Any):
        """A ``Report`` of a step compiled under this plan (see ``shardkit.report``)."""
        from shardkit.report.report import build_report

        return build_report(self, compiled, state, **kwargs)

    def report_model(self, model: Any, tx: Any, *, batch: int, seq: int, seed: int = 0):
        """Compile-only ``Report`` of a reference model's train step (nothing allocated)."""
        from shardkit import train

        init = train.init_fn(model, tx)
        with nnx.use_eager_sharding(False):
            annotated = jax.eval_shape(init, jax.random.key(seed))
        state = self._abstract_state(annotated)
        tokens = jax.ShapeDtypeStruct((batch, seq), np.int32)
        compiled = self.compile(
            train.train_step(model, tx), state, {"inputs": tokens, "targets": tokens}
        )
        return self.report(compiled, annotated, model_config=model.config, batch=batch, seq=seq)

    def compile(
        self,
        step_fn: Callable[..., Any],
        state: Any,
        batch: Any,
        *args: Any,
        donate_state: bool = True,
    ):
        """Compile ``step_fn`` without running it (arguments may be abstract)."""
        return self.lower(step_fn, state, batch, *args, donate_state=donate_state).compile()


class PlannedStep:
    """A step function jitted under a plan; compiled once per argument structure."""

    def __init__(self, plan: Plan, step_fn: Callable[..., Any], donate_state: bool):
        self.plan = plan
        self.step_fn = step_fn
        self.donate_state = donate_state
        self._cache: dict[Any, Any] = {}

    def _jitted(self, state: Any, batch: Any, n_extra: int):
        # Shardings follow the state's structure and the batch's shapes; state shapes are
        # fixed by its structure in training, and jax.jit itself retraces on new shapes.
        key = (jax.tree_util.tree_structure(state), _shapes(batch), n_extra)
        if key not in self._cache:
            plan = self.plan
            state_sh = plan.shardings(state)
            batch_sh = plan.batch_shardings(batch)

            def traced(state, batch, *extra):
                # NNX would otherwise read logical names as mesh axes when it rebuilds
                # Variables inside the step; shardings here come from the plan.
                with (
                    activation_rules(plan.activation_rules),
                    param_rules(plan.rules),
                    use_attention(plan.recipe.attention),
                    nnx.use_eager_sharding(False),
                ):
                    out = self.step_fn(state, batch, *extra)
                if not isinstance(out, tuple):
                    out = (out,)
                new_state, rest = out[0], out[1:]
                new_state = jax.lax.with_sharding_constraint(new_state, state_sh)
                return (new_state, *rest)

            self._cache[key] = jax.jit(
                traced,
                in_shardings=(state_sh, batch_sh, *([None] * n_extra)),
                donate_argnums=(0,) if self.donate_state else (),
            )
        return self._cache[key]

    def __call__(self, state: Any, batch: Any, *extra: Any):
        with jax.set_mesh(self.plan.mesh):
            return self._jitted(state, batch, len(extra))(state, batch, *extra)

    def lower(self, state: Any, batch: Any, *extra: Any):
        with jax.set_mesh(self.plan.mesh):
            return self._jitted(state, batch, len(extra)).lower(state, batch, *extra)


def _shapes(tree: Any) -> tuple:
    return tuple((np.shape(x), str(getattr(x, "dtype", ""))) for x in jax.tree.leaves(tree))
