"""``sk.Plan``: the one object between a model and a compiled, sharded step.

A plan joins a recipe (logical → mesh rules) with a mesh. It turns any state
tree into ``NamedSharding``s, describes a state before it exists
(``abstract_init``, an explicit :class:`~shardkit.state.AbstractState`), creates
state directly sharded, jits a user's ``step(state, batch)`` with derived in/out
shardings and donation, and places host batches (process-local slices in
multi-process runs). What a compiled step costs is :func:`shardkit.report.build_report`'s;
saving and restoring state, :mod:`shardkit.checkpoint`'s.

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

import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.extend.core as jax_core
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit import context
from shardkit.annotate.constrain import is_explicit
from shardkit.annotate.flax_meta import is_annotated_leaf
from shardkit.annotate.logical import LeafInfo, describe_leaves
from shardkit.annotate.path_axes import PathAxes
from shardkit.annotate.patterns import PatternAxes
from shardkit.annotate.unbox import unbox
from shardkit.balance import POSITIONS, ZIGZAG, balance_batch, zigzag_marker, zigzag_order
from shardkit.collectives import KINDS
from shardkit.dtypes import is_key, itemsize
from shardkit.errors import ArgumentTypeError, RuleError, ShardingError, ShardingWarning
from shardkit.explicit import auto_axes_error
from shardkit.mesh import check_devices, make_mesh
from shardkit.recipes import Recipe
from shardkit.recipes import get as get_recipe
from shardkit.recipes import names as recipe_names
from shardkit.recipes.tsp_layout import check_layout
from shardkit.rules import Rules
from shardkit.state import AbstractState, PlannedLeaf, TracedInit
from shardkit.workload import Workload

__all__ = ["Plan", "PlannedLeaf", "PlannedStep", "BATCH_AXES"]

#: Logical axes of batch arrays, by rank: examples, then sequence positions.
BATCH_AXES = ("batch", "length")

#: ``plan.init`` warns when a recipe meant to shard parameters (or optimizer state)
#: leaves more than this share of their bytes whole on every device.
_REPLICATED_WARN_SHARE = 0.5

#: ``plan.abstract_init`` keeps its trace for ``plan.init`` unless the trace holds more
#: than this many bytes of constants (arrays ``init_fn`` loads or closes over: pretrained
#: weights), which the ``AbstractState`` would keep alive; then ``plan.init`` traces again.
KEPT_INIT_CONSTANT_BYTES = 64 * 2**20


def _trace_init(init_fn: Callable[..., Any], args: tuple) -> tuple[Any, Any]:
    """``init_fn(*args)`` traced without eager NNX sharding: its jaxpr, and its output
    (boxes and all) as ``jax.ShapeDtypeStruct`` leaves."""
    with nnx.use_eager_sharding(False):
        return jax.make_jaxpr(init_fn, return_shape=True)(*args)


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
      precision: ``"f32"`` (default) or ``"bf16"``: mixed precision, activations and
        matrix products in bfloat16; parameters, gradients and optimizer state stay as
        stored (float32). It is part of the sharding context ``plan.jit`` enters
        (``sk.compute_dtype()``): the reference models follow it; a model of your own
        follows it only where it reads ``sk.compute_dtype()`` (a plan casts nothing).
      explicit: make the default mesh's axes ``AxisType.Explicit`` (JAX's
        sharding-in-types) instead of ``Auto``; a ``mesh`` given brings its own types,
        and ``explicit`` then only checks them.
    """

    def __init__(
        self,
        recipe: str | Recipe | Rules,
        mesh: Mesh | None = None,
        *,
        devices: Sequence[jax.Device] | None = None,
        annotations: PathAxes | Sequence[tuple[str, Sequence[str | None]]] | None = None,
        on_unmatched: Literal["replicate", "error"] | None = None,
        precision: context.Precision = "f32",
        explicit: bool | None = None,
    ):
        self.precision = context.check_precision(precision, "Plan(..., precision)")
        if not isinstance(recipe, (str, Recipe, Rules, list, tuple)):
            raise ArgumentTypeError(
                f"Plan takes a recipe name, a Recipe or Rules, got {type(recipe).__name__} "
                f"{recipe!r}.\nFix: e.g. sk.Plan('fsdp'); names: {', '.join(recipe_names())}."
            )
        if mesh is not None and not isinstance(mesh, Mesh):
            raise ArgumentTypeError(
                f"Plan(..., mesh=...) takes a jax.sharding.Mesh, got {type(mesh).__name__} "
                f"{mesh!r}.\nFix: mesh=sk.make_mesh({mesh!r})"
                + (" (sizes by axis name)." if isinstance(mesh, dict) else ", or leave it out.")
            )
        if mesh is not None and devices is not None:
            raise ShardingError(
                "Plan(recipe, mesh, devices=...): the mesh has its devices already.\n"
                "Fix: pass the mesh or the devices, not both."
            )
        if on_unmatched not in (None, "replicate", "error"):
            raise RuleError(
                f"Plan(on_unmatched=...) is 'replicate' or 'error', got {on_unmatched!r}."
            )
        if explicit is not None and not isinstance(explicit, bool):
            raise ArgumentTypeError(f"Plan(explicit=...) is True or False, got {explicit!r}.")
        if mesh is not None and explicit is not None and is_explicit(mesh) != explicit:
            kinds = "/".join(sorted({t.name for t in mesh.axis_types}))
            raise ShardingError(
                f"Plan(..., mesh, explicit={explicit}): the mesh's axes are {kinds}.\n"
                f"Fix: sk.make_mesh(..., explicit={explicit}), or leave explicit out."
            )
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
            devices = check_devices(jax.devices() if devices is None else devices)
            sizes = self.recipe.axis_sizes(len(devices))
            mesh = make_mesh(sizes, devices=devices, explicit=bool(explicit))
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
        check_layout(self.recipe, mesh.shape)

    # -- rules -------------------------------------------------------------------------
    @property
    def rules(self) -> Rules:
        return self.recipe.rules

    @property
    def activation_rules(self) -> Rules:
        return self.recipe.activation_rules

    @property
    def explicit(self) -> bool:
        """True when the mesh's axes are ``Explicit`` (sharding-in-types)."""
        return is_explicit(self.mesh)

    def __repr__(self) -> str:
        extra = "" if self.precision == "f32" else f", precision={self.precision!r}"
        extra += ", explicit=True" if self.explicit else ""
        return f"Plan({self.recipe.name!r}, mesh={dict(self.mesh.shape)}{extra})"

    def context(self, *, tokens: int | None = None, vocab: int | None = None):
        """The sharding context a step is traced under (``plan.jit`` enters it).

        ``tokens`` (of the step) and ``vocab`` (the model's) choose the logits' layout
        where the recipe splits the vocabulary over an axis that also splits the tokens
        (``Recipe.step_activation_rules``); ``plan.jit`` reads the tokens from the
        step's batch (its 2-D integer arrays) and leaves ``vocab`` to each array's own
        ``vocab`` dimension.
        """
        return context.using(
            param_rules=self.rules,
            activation_rules=self.step_activation_rules(tokens=tokens, vocab=vocab),
            attention=self.recipe.attention,
            attention_axis=self.recipe.attention_axis,
            layer_schedule=self.recipe.layer_schedule,
            expert_dispatch=self.recipe.expert_dispatch,
            precision=self.precision,
        )

    def step_activation_rules(
        self, *, tokens: int | None = None, vocab: int | None = None
    ) -> Rules:
        """The activation rules of a step of ``tokens`` tokens over a ``vocab`` vocabulary."""
        sizes = {str(k): int(v) for k, v in self.mesh.shape.items()}
        return self.recipe.step_activation_rules(sizes, tokens=tokens, vocab=vocab)

    # -- specs and shardings --------------------------------------------------------------
    def _rules_for(self, info: LeafInfo) -> Rules:
        if info.optimizer and self.recipe.optimizer_rules is not None:
            return self.recipe.optimizer_rules
        return self.rules

    def leaves(self, tree: Any) -> list[PlannedLeaf]:
        """Every leaf of ``tree`` with its kind, logical axes and ``PartitionSpec``.

        A leaf that already carries a ``NamedSharding`` on this plan's mesh (an array
        from ``plan.init``) reports the spec it has; an ``AbstractState`` its own leaves.
        """
        if isinstance(tree, AbstractState):
            return list(self._own(tree).leaves)
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
        treedef = jax.tree.structure(_tree_of(tree), is_leaf=is_annotated_leaf)
        return jax.tree.unflatten(treedef, [leaf.spec for leaf in self.leaves(tree)])

    def shardings(self, tree: Any) -> Any:
        """A tree of ``NamedSharding`` for params, optimizer state, or both.

        Leaves that already carry a ``NamedSharding`` on this plan's mesh (arrays
        from ``plan.init``) keep it; an ``AbstractState`` gives its own. The result
        depends on ``tree`` alone, never on what the plan did before.
        """
        if isinstance(tree, AbstractState):
            return self._own(tree).shardings
        treedef = jax.tree.structure(tree, is_leaf=is_annotated_leaf)
        return jax.tree.unflatten(
            treedef, [NamedSharding(self.mesh, leaf.spec) for leaf in self.leaves(tree)]
        )

    def _shards(self, rules: Rules) -> bool:
        """True if ``rules`` map some logical name to a mesh axis of size > 1 here."""
        return any(self.mesh.shape.get(a, 1) > 1 for a in rules.mesh_axis_names)

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
    def abstract_init(self, init_fn: Callable[..., Any], *args: Any) -> AbstractState:
        """``init_fn(*args)``'s state described, not created: an ``AbstractState``.

        Nothing is allocated: use it to compile-only plan a model of any size, to
        create the state (``plan.init(abstract)``), as ``plan.jit(step,
        state=abstract)`` for state that comes back as host arrays, for
        ``sk.report.build_report``, and (``abstract.tree``) as an orbax restore target.
        """
        return self._abstract_init(init_fn, args)

    def _abstract_init(self, init_fn: Callable[..., Any], args: tuple) -> AbstractState:
        # One trace serves both: its jaxpr is what plan.init compiles, so a model's init
        # (Flax's Python) is traced once, not again under jit.
        jaxpr, annotated = _trace_init(init_fn, args)
        held = sum(getattr(c, "nbytes", 0) for c in jaxpr.consts)  # arrays init_fn loads
        traced = TracedInit(init_fn, args, jaxpr) if held <= KEPT_INIT_CONSTANT_BYTES else None
        leaves = self.leaves(annotated)
        self._warn_if_replicated(leaves)
        flat, treedef = jax.tree.flatten(unbox(annotated))
        tree = jax.tree.unflatten(
            treedef,
            [
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(self.mesh, p.spec))
                for x, p in zip(flat, leaves, strict=True)
            ],
        )
        return AbstractState(tree, tuple(leaves), self.mesh, init_fn, args, traced)

    def init(self, init_fn: Callable[..., Any] | AbstractState, *args: Any) -> Any:
        """Run ``init_fn(*args)`` with its outputs born sharded; returns plain arrays.

        ``init_fn`` returns params (boxed linen params or an NNX ``State``) and
        optionally optimizer state built from them, in any container. Its traced
        program (one trace: the one that plans the state) runs under ``jit`` with
        ``out_shardings``, so no device ever holds the whole unsharded state.
        ``plan.init(abstract)`` creates the state an ``AbstractState`` describes, in
        its shardings, from the program ``plan.abstract_init`` traced.
        """
        abstract = self._own(init_fn) if isinstance(init_fn, AbstractState) else None
        if abstract is None:
            abstract = self._abstract_init(init_fn, args)
        elif args:
            raise ShardingError(
                "plan.init(abstract_state, ...): the abstract state knows its arguments.\n"
                "Fix: plan.init(abstract_state), or plan.init(init_fn, *args)."
            )
        if abstract.init_fn is None:
            raise ShardingError(
                "plan.init(abstract_state): this AbstractState was not made by "
                "plan.abstract_init, so it has no init function.\nFix: plan.init(init_fn, key)."
            )
        shardings = jax.tree.leaves(abstract.shardings)
        traced = abstract.traced
        if traced is not None and traced.of(abstract.init_fn, abstract.args):
            jaxpr = traced.jaxpr
        else:  # built by hand, its init replaced, or its trace held large constants
            jaxpr, _ = _trace_init(abstract.init_fn, abstract.args)
        run = jax_core.jaxpr_as_fun(jaxpr)
        with jax.set_mesh(self.mesh):
            leaves = jax.jit(lambda *a: run(*jax.tree.leaves(a)), out_shardings=shardings)(
                *abstract.args
            )
        return jax.tree.unflatten(jax.tree.structure(abstract.tree), leaves)

    def _own(self, abstract: AbstractState) -> AbstractState:
        """``abstract`` if it was planned on this plan's mesh, else a clear error."""
        if abstract.mesh != self.mesh:
            raise ShardingError(
                f"This AbstractState was planned on mesh {dict(abstract.mesh.shape)}, not on "
                f"this plan's {dict(self.mesh.shape)}.\nFix: make it with this plan "
                "(plan.abstract_init(init_fn, key)); to move a state between layouts, restore "
                "it into this plan's abstract state."
            )
        return abstract

    def _warn_if_replicated(self, leaves: Sequence[PlannedLeaf]) -> None:
        """Warn when a recipe meant to shard a kind of leaf left most of its bytes whole."""
        meant = {"param": self._shards(self.rules)}
        meant["optimizer"] = self._shards(self.recipe.optimizer_rules or self.rules)
        for kind, sharded in meant.items():
            rows = [leaf for leaf in leaves if leaf.kind == kind]
            total = sum(_nbytes(leaf) for leaf in rows)
            whole = [leaf for leaf in rows if all(e is None for e in leaf.spec)]
            replicated = sum(_nbytes(leaf) for leaf in whole)
            if not sharded or not total or replicated <= _REPLICATED_WARN_SHARE * total:
                continue
            unmatched = [leaf.path for leaf in whole if leaf.info.source == "unmatched"]
            if unmatched:
                why = f"{len(unmatched)} of them carry no logical axes (e.g. {unmatched[0]})"
                fix = (
                    "annotate the model (@sk.axes, Flax logical partitioning) or pass "
                    "Plan(..., annotations=sk.PathAxes([(regex, logical_axes), ...]))"
                )
            else:
                why = (
                    f"the recipe's rules map none of their logical axes (e.g. {whole[0].path}: "
                    f"{tuple(whole[0].axes)}) to a mesh axis"
                )
                fix = "add rules for those logical names, or use the names the recipe's rules use"
            label = {"param": "parameters", "optimizer": "optimizer state"}[kind]
            warnings.warn(
                f"Recipe {self.recipe.name!r} shards {label}, but {replicated / total:.0%} of "
                f"their bytes ({replicated:,} of {total:,}) stay replicated on every device of "
                f"{dict(self.mesh.shape)}: {why}.\nFix: {fix}; sk.logical_axes(state) shows "
                "what each leaf has.",
                ShardingWarning,
                stacklevel=_user_stacklevel(),
            )

    def balance_order(self, seq: int) -> np.ndarray | None:
        """The order :meth:`shard_batch` places a sequence of ``seq`` tokens in: the
        zigzag order over the recipe's ring (``Recipe.balance_axis``: its
        ``attention_axis``, USP's ring axis) when its ``balance`` is ``"zigzag"`` and that
        axis splits the sequence, else ``None`` (as given).

        Example:
          >>> import shardkit as sk
          >>> sk.Plan("cp").balance_order(32)[:6].tolist()   # rank 0: chunks 0 and 15
          [0, 1, 30, 31, 2, 3]
          >>> sk.Plan("fsdp").balance_order(32) is None
          True
        """
        axis = self.recipe.balance_axis
        if self.recipe.balance != "zigzag" or dict(self.mesh.shape).get(axis, 1) == 1:
            return None
        return zigzag_order(seq, self.mesh.shape[axis])

    def balance_batch(self, host_batch: Any) -> Any:
        """``host_batch`` in :meth:`balance_order`, with ``"positions"`` and
        ``"segment_ids"`` (:func:`shardkit.balance.balance_batch`); unchanged where the
        recipe does not balance, the batch is not a ``{"inputs": [rows, seq], ...}``
        dict, or it is packed already (``"segment_ids"``: its packer placed it,
        :func:`shardkit.packing.balance_permutation`). Rows it placed itself, one
        document each, are marked ``"zigzag"`` (:func:`shardkit.balance.zigzag_marker`):
        the ring then computes only their unmasked half blocks, statically."""
        inputs = host_batch.get("inputs") if isinstance(host_batch, Mapping) else None
        if inputs is None or np.ndim(inputs) != 2 or "segment_ids" in host_batch:
            return host_batch
        order = self.balance_order(np.shape(inputs)[1])
        if order is None:
            return host_batch
        placed = balance_batch(host_batch, order)
        if POSITIONS not in host_batch:  # the positions are the zigzag order it made
            placed[ZIGZAG] = zigzag_marker(self.mesh.shape[self.recipe.balance_axis])
        return placed

    def shard_batch(self, host_batch: Any) -> Any:
        """Global batch arrays from host arrays.

        In a multi-process run each process passes only its rows (contiguous,
        ``global_batch // process_count`` each); the global shape is inferred. Under a
        recipe that balances context parallelism (``balance="zigzag"``) the tokens are
        first reordered and their positions added (:meth:`balance_batch`).
        """
        processes = jax.process_count()
        host_batch = self.balance_batch(host_batch)

        def place(path, x):
            if is_key(getattr(x, "dtype", None)):  # typed keys travel as their key data
                data = place_array(path, np.asarray(jax.random.key_data(x)), x.ndim)
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            return place_array(path, np.asarray(x), np.ndim(x))

        def place_array(path, x, ndim):
            """``x`` placed by the batch sharding of its first ``ndim`` dimensions."""
            shape = (x.shape[0] * processes, *x.shape[1:]) if ndim else x.shape
            spec = self.batch_sharding(shape[:ndim], ("batch", *path)).spec
            sharding = NamedSharding(self.mesh, PartitionSpec(*spec, *[None] * (x.ndim - ndim)))
            if processes == 1:
                return jax.device_put(x, sharding)
            return jax.make_array_from_process_local_data(sharding, x, shape)

        return jax.tree_util.tree_map_with_path(place, host_batch)

    # -- steps ----------------------------------------------------------------------------
    def jit(
        self,
        step_fn: Callable[..., Any],
        *,
        state: AbstractState | None = None,
        donate_state: bool = True,
        **jit_kwargs: Any,
    ) -> PlannedStep:
        """``step_fn(state, batch, *extra)`` jitted with planned shardings.

        The state's shardings come from ``state`` (an ``AbstractState``) when given,
        else from the first call's arguments (arrays from ``plan.init`` keep their
        sharding; other leaves get the rules'). The batch is sharded by the
        activation rules; the step returns ``(new_state, *rest)`` with the state's
        sharding unchanged.

        Args:
          step_fn: the user's step.
          state: the layout of the state (for state that arrives as host arrays).
          donate_state: donate the state's buffers (ignored when ``donate_argnums``
            or ``donate_argnames`` is given).
          **jit_kwargs: passed to ``jax.jit`` (``static_argnums``, ``donate_argnums``,
            ``out_shardings``, ...). ``in_shardings`` covers the extra arguments
            only (positions 2, 3, ...; static ones excluded), as a tuple.
        """
        return PlannedStep(self, step_fn, state=state, donate_state=donate_state, **jit_kwargs)

    def lower(
        self,
        step_fn: Callable[..., Any],
        state: Any,
        batch: Any,
        *args: Any,
        donate_state: bool = True,
        **jit_kwargs: Any,
    ):
        """Lower ``step_fn`` for these (possibly abstract) arguments, as ``plan.jit`` would."""
        step = self.jit(step_fn, donate_state=donate_state, **jit_kwargs)
        return step.lower(state, batch, *args)

    def compile(
        self,
        step_fn: Callable[..., Any],
        state: Any,
        batch: Any,
        *args: Any,
        donate_state: bool = True,
        **jit_kwargs: Any,
    ):
        """Compile ``step_fn`` without running it (arguments may be abstract)."""
        lowered = self.lower(step_fn, state, batch, *args, donate_state=donate_state, **jit_kwargs)
        return lowered.compile()


class PlannedStep:
    """A step function jitted under a plan; compiled once per argument structure."""

    def __init__(
        self,
        plan: Plan,
        step_fn: Callable[..., Any],
        *,
        state: AbstractState | None = None,
        donate_state: bool = True,
        **jit_kwargs: Any,
    ):
        if state is not None and not isinstance(state, AbstractState):
            raise ShardingError(
                f"plan.jit(step, state=...) takes an AbstractState, got {type(state).__name__}."
                "\nFix: state=plan.abstract_init(init_fn, key)."
            )
        self.plan = plan
        self.step_fn = step_fn
        self.state = state
        self.donate_state = donate_state
        self.jit_kwargs = jit_kwargs
        self._cache: dict[Any, Any] = {}

    def _state_shardings(self, state: Any, abstract: AbstractState | None) -> Any:
        plan = self.plan
        abstract = plan._own(self.state) if self.state is not None else abstract
        if abstract is None:
            leaves = plan.leaves(state)
            # Leaves with a sharding already were planned (and checked) when created.
            planned = [
                leaf
                for leaf, x in zip(leaves, jax.tree.leaves(state), strict=True)
                if plan._existing(x) is None
            ]
            plan._warn_if_replicated(planned)
            treedef = jax.tree.structure(state)
            return jax.tree.unflatten(treedef, [NamedSharding(plan.mesh, x.spec) for x in leaves])
        want, got = jax.tree.structure(abstract.tree), jax.tree.structure(state)
        if want != got:
            raise ShardingError(
                "plan.jit(step, state=abstract): the state passed to the step has another "
                f"structure than the abstract state.\n  abstract: {want}\n  got:      {got}\n"
                "Fix: pass the state made by plan.init(abstract) (or restored into it)."
            )
        return abstract.shardings

    def _jitted(self, state: Any, batch: Any, n_extra: int, abstract: AbstractState | None):
        # Shardings follow the state's structure and the batch's shapes; state shapes are
        # fixed by its structure in training, and jax.jit itself retraces on new shapes.
        layout = None if abstract is None else tuple(jax.tree.leaves(abstract.shardings))
        key = (jax.tree_util.tree_structure(state), _shapes(batch), n_extra, layout)
        if key not in self._cache:
            plan = self.plan
            state_sh = self._state_shardings(state, abstract)
            batch_sh = plan.batch_shardings(batch)
            sizes = _step_sizes(batch)

            def traced(state, batch, *extra):
                # NNX would otherwise read logical names as mesh axes when it rebuilds
                # Variables inside the step; shardings here come from the plan.
                with plan.context(**sizes), nnx.use_eager_sharding(False):
                    out = self.step_fn(state, batch, *extra)
                if not isinstance(out, tuple):
                    out = (out,)
                new_state, rest = out[0], out[1:]
                # Explicit axes: the state's types may have drifted (zero1's update reads
                # split moments), and a constraint would only assert; reshard them back.
                pin = jax.sharding.reshard if plan.explicit else jax.lax.with_sharding_constraint
                try:
                    new_state = pin(new_state, state_sh)
                except ValueError:
                    given, returned = jax.tree.structure(state), jax.tree.structure(new_state)
                    if given == returned:
                        raise
                    raise ShardingError(
                        "plan.jit: the step returned its new state in another structure than "
                        f"the state it was given.\n  given:    {given}\n  returned: {returned}"
                        "\nFix: return (new_state, *outputs) with new_state built like the "
                        "state (NNX: nnx.as_pure(nnx.state(model, ...)) for plain arrays)."
                    ) from None
                return (new_state, *rest)

            kwargs = dict(self.jit_kwargs)
            n_args = 2 + n_extra
            static = kwargs.get("static_argnums", ())
            static = {static} if isinstance(static, int) else set(static)
            static = {i % n_args if -n_args <= i < n_args else i for i in static}
            if static & {0, 1}:
                raise ShardingError(
                    "plan.jit(..., static_argnums=...) names the state or the batch (positions "
                    "0, 1); the plan shards those.\nFix: static_argnums counts from 2."
                )
            if static:
                kwargs["static_argnums"] = tuple(sorted(static))
            dynamic_extra = [i for i in range(2, n_args) if i not in static]
            extra_sh = tuple(kwargs.pop("in_shardings", (None,) * len(dynamic_extra)))
            if len(extra_sh) != len(dynamic_extra):
                raise ShardingError(
                    f"plan.jit(..., in_shardings=...) gives {len(extra_sh)} sharding(s) for "
                    f"{len(dynamic_extra)} extra non-static argument(s).\nFix: one per extra "
                    "argument after (state, batch); the plan shards state and batch itself."
                )
            if "donate_argnums" not in kwargs and "donate_argnames" not in kwargs:
                kwargs["donate_argnums"] = (0,) if self.donate_state else ()
            self._cache[key] = jax.jit(
                traced, in_shardings=(state_sh, batch_sh, *extra_sh), **kwargs
            )
        return self._cache[key]

    def _prepare(self, state: Any, batch: Any, n_extra: int):
        """(the state as arrays, the jitted step); an ``AbstractState`` gives its layout."""
        abstract = self.plan._own(state) if isinstance(state, AbstractState) else None
        state = abstract.tree if abstract is not None else state
        return state, self._jitted(state, batch, n_extra, abstract)

    def __call__(self, state: Any, batch: Any, *extra: Any):
        if isinstance(state, AbstractState):
            raise ShardingError(
                "A step runs on arrays; an AbstractState only describes them.\nFix: "
                "step(plan.init(abstract), batch), or step.lower(abstract, batch) to compile."
            )
        with jax.set_mesh(self.plan.mesh), self._auto_axes_explained():
            state, jitted = self._prepare(state, batch, len(extra))
            return jitted(state, batch, *extra)

    @contextlib.contextmanager
    def _auto_axes_explained(self):
        """JAX's refusal of a model's mesh-axis ``out_sharding=`` under Auto axes, as a
        ``ShardingError`` that names the op and says ``explicit=True``."""
        try:
            yield
        except ValueError as e:
            error = None if self.plan.explicit else auto_axes_error(e, self.plan.recipe.name)
            if error is None:
                raise
            raise error from None

    def lower(self, state: Any, batch: Any, *extra: Any):
        with jax.set_mesh(self.plan.mesh), self._auto_axes_explained():
            state, jitted = self._prepare(state, batch, len(extra))
            # An abstract batch without shardings gets the plan's: under Explicit axes a
            # ShapeDtypeStruct's sharding is its type inside the step (a shard_map checks it).
            batch = jax.tree.map(_with_sharding, batch, self.plan.batch_shardings(batch))
            return jitted.lower(state, batch, *extra)


def _with_sharding(x: Any, sharding: NamedSharding) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x


def _tree_of(tree: Any) -> Any:
    return tree.tree if isinstance(tree, AbstractState) else tree


def _shapes(tree: Any) -> tuple:
    return tuple((np.shape(x), str(getattr(x, "dtype", ""))) for x in jax.tree.leaves(tree))


def _nbytes(leaf: PlannedLeaf) -> int:
    return int(np.prod(leaf.shape)) * itemsize(leaf.info.dtype)


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside shardkit."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def _step_sizes(batch: Any) -> dict[str, int | None]:
    """``{"tokens": ...}`` of a step: its batch's token count (2-D integer arrays)."""
    workload = Workload.of_batch(batch)
    return {"tokens": workload.batch * workload.seq if workload and workload.seq else None}
