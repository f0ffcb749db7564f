"""A model's cut (:class:`~shardkit.protocol.Stages`) run as a pipeline under a plan.

:func:`pipeline_value_and_grad` runs ``stages.loss`` as a pipeline under a plan whose
recipe lays ``layers`` over ``stage`` (``pp``, ``dp_pp``, ``zeropp``, ``dp_tp_sp_pp``),
with every leaf's ``PartitionSpec`` taken from the plan. The cut comes from the model
(``model.stages()``, :mod:`shardkit.protocol`); the engine never names one.
``shardkit.train.train_step`` is the training step around it. :func:`to_interleaved` /
:func:`from_interleaved` convert a state between layer order and the order the
``interleaved`` schedule stores (:func:`order_converters`: both, jitted for a plan).

Example:
  >>> import jax, shardkit as sk
  >>> model = sk.models.get("gpt-tiny", n_layers=4)
  >>> plan = sk.Plan("pp", devices=jax.devices()[:4])
  >>> abstract = jax.eval_shape(model.init, jax.random.key(0))
  >>> grad = pipeline_value_and_grad(model.stages(), plan, abstract, microbatches=4)
  >>> grad.schedule.name, grad.auto_axes   # call it as grad(params, batch), under the plan
  ('1f1b', ())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shardkit.errors import NotPipelinableError
from shardkit.parallel import pipeline
from shardkit.protocol import Stages

__all__ = [
    "from_interleaved",
    "order_converters",
    "pipeline_value_and_grad",
    "to_interleaved",
]


def _params_of(abstract: Any) -> Any:
    """The params part of an abstract train state (``TrainState.params``) or the params."""
    tree = getattr(abstract, "tree", abstract)
    return getattr(tree, "params", tree)


def pipeline_value_and_grad(
    stages: Stages,
    plan: Any,
    abstract_params: Any,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    unit: int | None = None,
    stack_order: str = "layers",
    rolled: bool = True,
) -> pipeline.PipelinedGrad:
    """``fn(params, batch) -> (loss, grads)`` of ``stages.loss``, run as a pipeline under ``plan``.

    Args:
      stages: the model cut (:class:`Stages`).
      plan: an ``sk.Plan`` whose mesh has a ``stage`` axis and whose rules lay ``layers``
        over it.
      abstract_params: the params with their logical axes (``jax.eval_shape(init, key)``
        of the annotated params), or an ``AbstractState`` whose tree has ``.params``.
      microbatches, schedule, virtual_stages, unit, stack_order, rolled: see
        :func:`shardkit.parallel.pipeline.mesh_value_and_grad` (``stack_order="interleaved"``:
        ``params[key]`` stored as :func:`to_interleaved` gives it).

    Returns:
      a :class:`~shardkit.parallel.pipeline.PipelinedGrad` (call it; it carries its
      ``schedule``).

    Raises:
      NotPipelinableError: the plan has no ``stage`` axis or lays nothing over it.
    """
    mesh = plan.mesh
    if pipeline.STAGE not in mesh.shape:
        raise NotPipelinableError(
            f"Recipe {plan.recipe.name!r} (mesh {dict(mesh.shape)}) has no 'stage' axis to "
            "pipeline over.\nFix: a pipeline recipe (pp, dp_pp, zeropp, dp_tp_sp_pp), or the plain "
            "train step for this recipe."
        )
    if hasattr(abstract_params, "leaves") and hasattr(abstract_params, "tree"):
        specs_tree = jax.tree.unflatten(
            jax.tree.structure(abstract_params.tree),
            [leaf.spec for leaf in abstract_params.leaves],
        )
        specs = _params_of(specs_tree)
    else:
        specs = plan.specs(abstract_params)
    s_specs, r_specs = stages.split(specs)
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    first = {tuple(sp)[0] if len(sp) else None for sp in jax.tree.leaves(s_specs, is_leaf=is_spec)}
    if first != {pipeline.STAGE}:
        raise NotPipelinableError(
            f"Recipe {plan.recipe.name!r} lays the stack's leading 'layers' axis over "
            f"{sorted(map(str, first))}, not over 'stage' alone.\nFix: a recipe with the rule "
            "('layers', 'stage') (pp, dp_pp, zeropp, dp_tp_sp_pp)."
        )
    for sp in jax.tree.leaves(r_specs, is_leaf=is_spec):
        if pipeline.STAGE in {a for e in sp for a in pipeline.spec_axes(e)}:
            raise NotPipelinableError(
                f"A non-layer parameter is sharded over 'stage' ({sp}); only the stack is cut "
                "into stages.\nFix: map only 'layers' to 'stage' in the recipe's rules."
            )
    batch_spec = plan.batch_sharding((mesh.size, mesh.size)).spec  # sizes every axis divides
    batch_axes = pipeline.spec_axes(tuple(batch_spec)[0]) if len(batch_spec) else ()
    # Axes that split neither the stack into stages nor the batch (``tensor``): left to
    # XLA, which shards each stage's layers by the plan's rules (dp_tp_sp_pp).
    auto_axes = tuple(
        a
        for a in mesh.axis_names
        if a != pipeline.STAGE and a not in batch_axes and mesh.shape[a] > 1
    )
    run = pipeline.mesh_value_and_grad(
        stages.layer,
        stages.pre,
        stages.post,
        mesh=mesh,
        microbatches=microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        unit=unit,
        stack_specs=s_specs,
        rest_specs=r_specs,
        batch_axes=batch_axes,
        auto_axes=auto_axes,
        stack_order=stack_order,
        post_grad=stages.post_grad,
        rolled=rolled,
    )

    def fn(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        stack, rest = stages.split(params)
        loss, (d_stack, d_rest) = run(stack, rest, batch)
        # The params' own containers (an nnx.State stays one); same leaves, same order.
        leaves = jax.tree.leaves(stages.merge(d_stack, d_rest))
        return loss, jax.tree.unflatten(jax.tree.structure(params), leaves)

    return pipeline.PipelinedGrad(fn, schedule=run.schedule, auto_axes=run.auto_axes)


def _reorder(tree: Any, key: str, perm_of: Callable[[int], Any]) -> Any:
    def one(path: Any, x: Any) -> Any:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if key not in names or not hasattr(x, "shape") or not x.shape:
            return x
        return jnp.take(x, jnp.asarray(perm_of(int(x.shape[0]))), axis=0)

    return jax.tree_util.tree_map_with_path(one, tree)


def to_interleaved(
    tree: Any, stages: int, virtual: int, *, key: str = "layers", schedule: str = "interleaved"
) -> Any:
    """Every array under a ``key`` entry of ``tree`` (a TrainState: the parameters and the
    optimizer's moments) reordered along its leading (layer) axis into the order
    ``schedule`` stores (``stack_order="interleaved"``:
    :func:`shardkit.parallel.pipeline.stored_order`, a V for ``zbv``).

    Run it once (jitted with the state's shardings), then train with
    ``shardkit.train.train_step(..., pipeline={"schedule": "interleaved"})``.

    Example:
      >>> import jax.numpy as jnp
      >>> to_interleaved({"layers": jnp.arange(4), "emb": jnp.arange(4)}, 2, 2)["layers"]
      Array([0, 2, 1, 3], dtype=int32)
    """
    return _reorder(tree, key, lambda n: pipeline.stored_order(schedule, n, stages, virtual))


def from_interleaved(
    tree: Any, stages: int, virtual: int, *, key: str = "layers", schedule: str = "interleaved"
) -> Any:
    """The inverse of :func:`to_interleaved`: the stacks back in layer order.

    Example:
      >>> import jax.numpy as jnp
      >>> from_interleaved({"layers": jnp.array([0, 2, 1, 3])}, 2, 2)["layers"]
      Array([0, 1, 2, 3], dtype=int32)
    """
    return _reorder(
        tree, key, lambda n: np.argsort(pipeline.stored_order(schedule, n, stages, virtual))
    )


def order_converters(
    plan: Any, abstract: Any, stages: int, virtual: int, schedule: str = "interleaved"
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``(to_stored, to_layers)``: :func:`to_interleaved` / :func:`from_interleaved` of a
    whole state in ``schedule``'s order, each jitted once, its output laid out as
    ``abstract`` lays the state."""
    shardings = jax.tree.map(lambda x: x.sharding, getattr(abstract, "tree", abstract))

    def jitted(convert: Callable[..., Any]) -> Callable[[Any], Any]:
        fn = jax.jit(
            lambda state: convert(state, stages, virtual, schedule=schedule),
            out_shardings=shardings,
        )

        def apply(state: Any) -> Any:
            with jax.set_mesh(plan.mesh):
                return fn(state)

        return apply

    return jitted(to_interleaved), jitted(from_interleaved)
