"""A model cut for a pipeline: ``pre`` → a stack of identical layers → ``post``.

:class:`Stages` holds the three functions and where the stack sits in the parameters (a
top-level key, ``"layers"`` by default: what linen ``nn.scan`` and NNX ``nnx.vmap`` give a
module called ``layers``). :func:`value_and_grad` runs a model's loss as a pipeline under a
plan whose recipe lays ``layers`` over ``stage`` (``pp``, ``dp_pp``, ``zeropp``), with every
leaf's ``PartitionSpec`` taken from the plan. :func:`train_step` is the ordinary training
step around it; :func:`reference_stages` cuts the reference GPT (linen) and Llama (NNX).

Your own stack of identical layers:

- linen: the block you ``nn.scan`` (``layer = linen_layer(Block(...))``);
- NNX: the module you built with ``nnx.vmap`` (``layer = nnx_layer(model.layers)``).

Example:
  >>> import jax, jax.numpy as jnp, optax, shardkit as sk
  >>> from shardkit.models import get
  >>> from shardkit import train
  >>> model, tx = get("gpt-tiny", n_layers=4), train.adamw()
  >>> plan = sk.Plan("pp", devices=jax.devices()[:4])
  >>> abstract = plan.abstract_init(train.init_fn(model, tx), jax.random.key(0))
  >>> abstract.leaf("params/layers/mlp/up/kernel").spec
  P('stage', None, None)
  >>> step = train_step(reference_stages(model), tx, plan, abstract, microbatches=4)
  >>> state = plan.init(abstract)
  >>> tokens = jnp.zeros((8, 16), jnp.int32)
  >>> batch = {"inputs": tokens, "targets": tokens}
  >>> want = model.loss(state.params, batch)                    # one program, no pipeline
  >>> state, metrics = plan.jit(step, state=abstract)(state, batch)
  >>> bool(jnp.allclose(metrics["loss"], want, rtol=1e-5))
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from shardkit.parallel import pipeline
from shardkit.parallel.schedules import PipelineError

__all__ = [
    "Stages",
    "from_interleaved",
    "head_post_grad",
    "linen_layer",
    "nnx_layer",
    "reference_stages",
    "to_interleaved",
    "train_step",
    "value_and_grad",
    "NotPipelinableError",
]


class NotPipelinableError(PipelineError):
    """A model or recipe that cannot run as a pipeline (no scanned stack, no stage axis)."""


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model as ``pre(rest, mb) -> x``, ``layer(layer_params, x) -> x``, ``post(rest, y, mb)
    -> mean loss``, with its layers stacked under ``params[key]``.

    Example:
      >>> import jax.numpy as jnp
      >>> st = Stages(pre=lambda r, mb: mb["x"] * r["a"], layer=lambda w, x: x * w,
      ...             post=lambda r, y, mb: jnp.mean(y))
      >>> params = {"layers": jnp.array([2.0, 3.0]), "a": jnp.array(1.0)}
      >>> float(st.loss(params, {"x": jnp.ones(4)}))
      6.0
    """

    pre: Callable[[Any, Any], jax.Array]
    layer: Callable[[Any, jax.Array], jax.Array]
    post: Callable[[Any, jax.Array, Any], jax.Array]
    key: str = "layers"
    #: Optional: ``post``'s loss and gradients added into a running sum, ``(rest, y, mb,
    #: d_rest, scale) -> (scale·loss, d_rest + scale·∂loss/∂rest, scale·∂loss/∂y)``; the
    #: pipeline's last stage calls it instead of ``jax.value_and_grad(post)`` plus an add
    #: (see :func:`head_post_grad`: a vocabulary head's gradient written in place).
    post_grad: Callable[..., tuple[jax.Array, Any, jax.Array]] | None = None

    def split(self, params: Any) -> tuple[Any, Any]:
        """``(params[key], the rest)``; raises ``NotPipelinableError`` if there is no stack."""
        try:
            stack = params[self.key]
        except (KeyError, TypeError):
            keys = list(params) if hasattr(params, "keys") else type(params).__name__
            raise NotPipelinableError(
                f"No stacked layers under {self.key!r} in the parameters (top-level keys: "
                f"{keys}). A pipeline cuts a stack of identical layers with a leading "
                "'layers' axis.\nFix: build the layers with nn.scan / nnx.vmap (reference "
                "models: scan=True), or Stages(..., key=<the stack's key>)."
            ) from None
        return stack, {k: params[k] for k in params if k != self.key}

    def merge(self, stack: Any, rest: Any) -> Any:
        """The inverse of :meth:`split`."""
        out = {k: rest[k] for k in rest}
        out[self.key] = stack
        return out

    def loss(self, params: Any, batch: Any) -> jax.Array:
        """The un-pipelined loss: ``post(rest, scan(layer)(pre(rest, batch)), batch)``."""
        stack, rest = self.split(params)
        x = self.pre(rest, batch)
        x = jax.lax.scan(lambda h, w: (self.layer(w, h), None), x, stack)[0]
        return self.post(rest, x, batch)


def linen_layer(block: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """``layer(params, x)`` for a linen block (the module ``nn.scan`` stacks).

    The block may return ``x`` or ``(x, carry_out)`` (the ``nn.scan`` convention).

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> layer = linen_layer(nn.Dense(4))
      >>> w = nn.Dense(4).init(jax.random.key(0), jnp.ones((1, 4)))["params"]
      >>> layer(w, jnp.ones((2, 4))).shape
      (2, 4)
    """

    def layer(params: Any, x: jax.Array) -> jax.Array:
        out = block.apply({"params": params}, x)
        return out[0] if isinstance(out, tuple) else out

    return layer


def nnx_layer(layers: Any, *args: Any) -> Callable[[Any, jax.Array], jax.Array]:
    """``layer(state, x)`` for an NNX module built with ``nnx.vmap`` (one slice of its state).

    ``args`` are passed after ``x`` (e.g. rotary tables).

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> import jax.numpy as jnp
      >>> @nnx.vmap(in_axes=0, out_axes=0)
      ... def make(key):
      ...     return nnx.Linear(4, 4, rngs=nnx.Rngs(key))
      >>> stack = make(jax.random.split(jax.random.key(0), 3))
      >>> layer = nnx_layer(stack)
      >>> state = nnx.state(stack, nnx.Param)
      >>> layer(jax.tree.map(lambda a: a[0], state), jnp.ones((2, 4))).shape
      (2, 4)
    """
    graphdef, _ = nnx.split(layers)

    def layer(state: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x, *args)

    return layer


def _split_specs(stages: Stages, plan: Any, abstract: Any) -> tuple[Any, Any]:
    specs = plan.specs(abstract)
    return stages.split(specs)


def _params_of(abstract: Any) -> Any:
    """The params part of an abstract train state (``TrainState.params``) or the params."""
    tree = getattr(abstract, "tree", abstract)
    return getattr(tree, "params", tree)


def value_and_grad(
    stages: Stages,
    plan: Any,
    abstract_params: Any,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    unit: int | None = None,
    stack_order: str = "layers",
) -> Callable[[Any, Any], tuple[jax.Array, Any]]:
    """``fn(params, batch) -> (loss, grads)`` run as a pipeline under ``plan``.

    Args:
      stages: the model cut (:class:`Stages`).
      plan: an ``sk.Plan`` whose mesh has a ``stage`` axis and whose rules lay ``layers``
        over it.
      abstract_params: the params with their logical axes (``jax.eval_shape(init, key)``
        of the annotated params), or an ``AbstractState`` whose tree has ``.params``.
      microbatches, schedule, virtual_stages, unit, stack_order: see
        :func:`shardkit.parallel.pipeline.value_and_grad` (``stack_order="interleaved"``:
        ``params[key]`` stored as :func:`to_interleaved` gives it).

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
    run = pipeline.value_and_grad(
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
    )

    def fn(params: Any, batch: Any) -> tuple[jax.Array, Any]:
        stack, rest = stages.split(params)
        loss, (d_stack, d_rest) = run(stack, rest, batch)
        # The params' own containers (an nnx.State stays one); same leaves, same order.
        leaves = jax.tree.leaves(stages.merge(d_stack, d_rest))
        return loss, jax.tree.unflatten(jax.tree.structure(params), leaves)

    fn.schedule = run.schedule  # type: ignore[attr-defined]
    fn.auto_axes = run.auto_axes  # type: ignore[attr-defined]
    return fn


def train_step(
    stages: Stages,
    tx: Any,
    plan: Any,
    abstract: Any,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    unit: int | None = None,
    return_grads: bool = False,
    stack_order: str = "layers",
) -> Callable[[Any, dict], tuple[Any, dict]]:
    """``step(state, batch) -> (state, {"loss": ...})`` for a ``shardkit.train.TrainState``,
    the loss and gradients computed by the pipeline (see :func:`value_and_grad`).

    ``stack_order="interleaved"`` (``interleaved`` schedule): the state's layer stacks
    (parameters and Adam moments alike, Adam being elementwise) are stored in the
    schedule's order, converted once by :func:`to_interleaved` (and back by
    :func:`from_interleaved` to evaluate or save): the step moves no weights between
    stages. In layer order the engine reorders the stack and its gradient every step."""
    import optax

    from shardkit.train import TrainState

    grad_fn = value_and_grad(
        stages,
        plan,
        abstract,
        microbatches=microbatches,
        schedule=schedule,
        virtual_stages=virtual_stages,
        unit=unit,
        stack_order=stack_order,
    )

    def step(state: Any, batch: dict) -> tuple[Any, dict]:
        loss, grads = grad_fn(state.params, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grads": grads} if return_grads else {"loss": loss}
        return TrainState(state.step + 1, params, opt_state), metrics

    step.schedule = grad_fn.schedule  # type: ignore[attr-defined]
    # What plan.report's analytic model needs to count a pipelined step.
    step.pipeline = {
        "microbatches": microbatches,
        "schedule": schedule,  # type: ignore[attr-defined]
        "virtual_stages": virtual_stages,
        "unit": unit,
    }
    return step


def _reorder(tree: Any, key: str, perm_of: Callable[[int], Any]) -> Any:
    def one(path: Any, x: Any) -> Any:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if key not in names or not hasattr(x, "shape") or not x.shape:
            return x
        return jnp.take(x, jnp.asarray(perm_of(int(x.shape[0]))), axis=0)

    return jax.tree_util.tree_map_with_path(one, tree)


def to_interleaved(tree: Any, stages: int, virtual: int, *, key: str = "layers") -> Any:
    """Every array under a ``key`` entry of ``tree`` (a TrainState: the parameters and the
    optimizer's moments) reordered along its leading (layer) axis into the order the
    ``interleaved`` schedule stores (:func:`shardkit.parallel.pipeline.interleaved_order`).

    Run it once (jitted with the state's shardings), then train with
    ``train_step(..., schedule="interleaved", stack_order="interleaved")``.

    Example:
      >>> import jax.numpy as jnp
      >>> to_interleaved({"layers": jnp.arange(4), "emb": jnp.arange(4)}, 2, 2)["layers"]
      Array([0, 2, 1, 3], dtype=int32)
    """
    return _reorder(tree, key, lambda n: pipeline.interleaved_order(n, stages, virtual))


def from_interleaved(tree: Any, stages: int, virtual: int, *, key: str = "layers") -> Any:
    """The inverse of :func:`to_interleaved`: the stacks back in layer order.

    Example:
      >>> import jax.numpy as jnp
      >>> from_interleaved({"layers": jnp.array([0, 2, 1, 3])}, 2, 2)["layers"]
      Array([0, 1, 2, 3], dtype=int32)
    """
    return _reorder(tree, key, lambda n: np.argsort(pipeline.interleaved_order(n, stages, virtual)))


def head_post_grad(
    norm: Callable[[Any, jax.Array], jax.Array],
    *,
    norm_key: str,
    head_key: str,
    vocab_axis: int,
    dtype: Callable[[], Any] | None = None,
) -> Callable[..., tuple[jax.Array, Any, jax.Array]]:
    """A :class:`Stages` ``post_grad`` for ``post = cross-entropy(head(norm(y)))``.

    ``norm(norm_params, y)`` is the final norm (``rest[norm_key]`` its parameters);
    ``rest[head_key]`` holds the head's one weight, ``[vocab, d]`` (``vocab_axis=0``, a
    tied embedding table) or ``[d, vocab]`` (``vocab_axis=1``); ``dtype()`` gives the
    products' dtype when traced (default the norm's output dtype). The head's gradient is
    written into the running sum in vocabulary slices (:func:`shardkit.nn.loss.
    head_loss_and_grad`), so the last stage never holds it twice; the loss is the mean
    cross-entropy of ``mb["targets"]``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> norm = lambda p, y: y * p["g"]
      >>> rest = {"ln": {"g": jnp.ones(4)}, "head": {"w": jnp.ones((4, 10))}}
      >>> pg = head_post_grad(norm, norm_key="ln", head_key="head", vocab_axis=1)
      >>> mb = {"targets": jnp.zeros((2, 3), jnp.int32)}
      >>> zeros = jax.tree.map(jnp.zeros_like, rest)
      >>> loss, d_rest, dy = pg(rest, jnp.ones((2, 3, 4)), mb, zeros, 1.0)
      >>> round(float(loss), 4), d_rest["head"]["w"].shape   # uniform over 10: log 10
      (2.3026, (4, 10))
    """
    from shardkit.nn.loss import head_loss_and_grad

    def post_grad(rest: Any, y: jax.Array, mb: Any, d_rest: Any, scale: Any):
        z, pull = jax.vjp(norm, rest[norm_key], y)
        (weight,), w_def = jax.tree.flatten(rest[head_key])
        (acc,) = jax.tree.leaves(d_rest[head_key])
        loss, dz, acc = head_loss_and_grad(
            z,
            mb["targets"],
            weight,
            acc,
            vocab_axis=vocab_axis,
            scale=scale,
            dtype=None if dtype is None else dtype(),
        )
        d_norm, dy = pull(dz)
        out = {k: d_rest[k] for k in d_rest}
        out[norm_key] = jax.tree.map(jnp.add, d_rest[norm_key], d_norm)
        out[head_key] = jax.tree.unflatten(w_def, [acc])
        return loss, out, dy

    return post_grad


def reference_stages(model: Any) -> Stages:
    """The reference GPT (linen) or Llama (NNX) cut into embedding, blocks and head.

    The same operations as ``model.loss``, in the same order (a test checks they agree).

    Raises:
      NotPipelinableError: the model's layers are not scanned (``scan=False``).
    """
    from shardkit.nn.loss import cross_entropy

    cfg = model.config
    if not cfg.scan:
        raise NotPipelinableError(
            f"{model.name}: scan=False keeps its {cfg.n_layers} layers as separate "
            "parameters (layers_0, ...); a pipeline cuts one stacked 'layers' axis.\n"
            f"Fix: get({model.name!r}, scan=True) (the default)."
        )

    def loss_of(logits: jax.Array, mb: Any) -> jax.Array:
        return cross_entropy(logits.astype(jnp.float32), mb["targets"]).mean()

    def remat(fn: Callable) -> Callable:
        if cfg.remat == "none":
            return fn
        from shardkit.models.gpt import checkpoint_policy

        return jax.checkpoint(fn, prevent_cse=False, policy=checkpoint_policy(cfg.remat))

    if cfg.family == "gpt":
        import flax.linen as nn

        from shardkit.models.gpt import LN_EPS, Block

        def pre(rest: Any, mb: Any) -> jax.Array:
            tokens = mb["inputs"]
            table = rest["wte"]["embedding"].astype(cfg.compute_dtype)
            x = jnp.take(table, tokens, axis=0)
            x = x + jnp.take(rest["wpe"]["embedding"], jnp.arange(tokens.shape[-1])[None], axis=0)
            return x.astype(cfg.compute_dtype)

        layer = remat(linen_layer(Block(cfg)))

        def final_norm(params: Any, y: jax.Array) -> jax.Array:
            # Built when traced: the compute dtype is the plan's (sk.compute_dtype()).
            norm = nn.LayerNorm(
                epsilon=LN_EPS, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype
            )
            return norm.apply({"params": params}, y)

        def post(rest: Any, y: jax.Array, mb: Any) -> jax.Array:
            y = final_norm(rest["ln_f"], y)
            table = rest["wte"]["embedding"].astype(cfg.compute_dtype)
            return loss_of(jnp.einsum("...d,vd->...v", y, table), mb)

        post_grad = head_post_grad(
            final_norm,
            norm_key="ln_f",
            head_key="wte",
            vocab_axis=0,
            dtype=lambda: cfg.compute_dtype,
        )
        return Stages(pre, layer, post, post_grad=post_grad)

    from shardkit.nn.rope import rope_tables

    def graphdef(part: str) -> Any:
        # An NNX module fixes its compute dtype when built: read it when traced, under the
        # plan's precision (``model.module`` is built once per dtype).
        return nnx.split(getattr(model.module, part))[0]

    def pre(rest: Any, mb: Any) -> jax.Array:
        return nnx.merge(graphdef("embed"), rest["embed"])(mb["inputs"]).astype(cfg.compute_dtype)

    def block(state: Any, x: jax.Array) -> jax.Array:
        cos, sin = rope_tables(x.shape[1], cfg.head_dim)
        return nnx.merge(graphdef("layers"), state)(x, cos, sin)

    def final_norm(params: Any, y: jax.Array) -> jax.Array:
        return nnx.merge(graphdef("norm"), params)(y)

    def post(rest: Any, y: jax.Array, mb: Any) -> jax.Array:
        y = final_norm(rest["norm"], y)
        return loss_of(nnx.merge(graphdef("head"), rest["head"])(y), mb)

    post_grad = head_post_grad(
        final_norm, norm_key="norm", head_key="head", vocab_axis=1, dtype=lambda: cfg.compute_dtype
    )
    return Stages(pre, remat(block), post, post_grad=post_grad)
