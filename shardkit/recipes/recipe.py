"""``Recipe``: a sharding layout as plain data.

A recipe owns the *logical → mesh* half of the flow: which mesh axes exist and
how to size them from a device count, the rules for parameters (and, where
they differ, for optimizer state), the rules for activations and the batch,
and the attention strategy. It never names a parameter path.

Example:
  >>> import shardkit as sk
  >>> r = sk.recipes.get("fsdp")
  >>> r.axis_sizes(8)
  {'fsdp': 8}
  >>> r.rules.spec(("embed", "mlp"))
  P('fsdp', None)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Literal, get_args

from shardkit.context import context_axes
from shardkit.errors import ShardingError
from shardkit.mesh import resolve_axis_sizes
from shardkit.rules import Rules

__all__ = [
    "BALANCE_OF",
    "LogitsLayout",
    "Parallelism",
    "Recipe",
    "VocabRules",
    "expected_collectives",
]

#: How a recipe lays out the logits when its activation rules split the vocabulary over
#: a mesh axis that also splits the tokens (``fsdp``): ``"vocab"`` as the rules say,
#: ``"tokens"`` without those vocabulary rules, ``"auto"`` picks per step (see
#: :meth:`Recipe.step_activation_rules`).
LogitsLayout = Literal["auto", "vocab", "tokens"]

#: The token order each attention strategy needs (:meth:`Recipe.with_attention`): the
#: ring (alone or in USP) the zigzag, so every rank attends as many causal pairs; the
#: others none: all-gather attention scores each local query against the whole sequence
#: (masked or not), Ulysses attends whole sequences for a share of the heads.
BALANCE_OF = {"ring": "zigzag", "usp": "zigzag", "allgather": "none", "ulysses": "none"}
BALANCE_OF["dense"] = "none"
_ONE_AXIS = ("ring", "allgather", "ulysses", "dense")

#: Logical names of an activation's token dimensions.
_TOKEN_NAMES = ("batch", "length")

#: Logical names whose weights Megatron splits: a mesh axis that shards them is a
#: tensor-parallel axis.
_TENSOR_NAMES = frozenset({"heads", "kv_heads", "mlp"})


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The degree of each kind of parallelism a recipe runs on a mesh.

    Read from the recipe's rules (never from its name), so a custom recipe gets
    the same analysis as a built-in one. A mesh axis that shards

    - heads or MLP units (``heads``, ``kv_heads``, ``mlp``) of the parameters, but not the
      batch, is ``tensor`` (``tensor_kind="tp_sp"`` if it also splits activations'
      ``length``);
    - other parameter dimensions (``embed``, ``vocab``) is ``fsdp``;
    - only the batch is ``data`` (``data_kind="zero1"`` if it shards optimizer state);
    - only the activations' ``length`` is ``sequence``;
    - other parameter dimensions *and* the activations' ``length`` is ``tsp``
      (tensor and sequence parallelism folded onto one axis: each device holds 1/D of
      every weight and S/D of the tokens; ``tsp_kind`` is the recipe's
      ``layer_schedule``, ``"gspmd"`` or ``"tsp"``).

    Axes that shard nothing count as 1.
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    sequence: int = 1
    data_kind: Literal["dp", "zero1"] = "dp"
    tensor_kind: Literal["tp", "tp_sp"] = "tp"
    tsp: int = 1
    tsp_kind: Literal["gspmd", "tsp"] = "gspmd"
    #: pipeline stages: a mesh axis that shards only the ``layers`` axis of the stack.
    stage: int = 1
    #: expert parallelism: mesh axes that split the experts (``expert``) of an MoE
    #: layer; what such an axis does to the rest of the state is its role above.
    expert: int = 1

    def sizes(self) -> dict[str, int]:
        """``{"data": d, "fsdp": f, "tensor": t, "sequence": c}``."""
        return {
            "data": self.data,
            "fsdp": self.fsdp,
            "tensor": self.tensor,
            "sequence": self.sequence,
        }


def _names_on(rules: Rules | None, axis: str) -> set[str]:
    """Logical names that ``rules`` map (in any rule) onto mesh axis ``axis``."""
    out = set()
    for name, axes in rules or ():
        if axis == axes or (isinstance(axes, tuple) and axis in axes):
            out.add(name)
    return out


def _as_tuple(axes: object) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _axes_of(rules: Rules | None, name: str) -> list[str]:
    """Mesh axes that any rule for logical ``name`` maps it to, in order."""
    out: list[str] = []
    for rule_name, axes in rules or ():
        if rule_name == name:
            out += [a for a in _as_tuple(axes) if a not in out]
    return out


class VocabRules(Rules):
    """Activation rules whose vocabulary-splitting rules apply to an array only while its
    ``vocab`` dimension is at least ``gathered``, the tokens each device would gather
    for it; other arrays are resolved by ``without`` (the rules less those).

    See :meth:`Recipe.step_activation_rules`.

    Example:
      >>> rules = VocabRules(Rules([("vocab", "fsdp"), ("batch", "fsdp")]),
      ...                    Rules([("batch", "fsdp")]), gathered=4096)
      >>> rules.spec(("batch", "vocab"), shape=(4096, 50304))
      P(None, 'fsdp')
      >>> rules.spec(("batch", "vocab"), shape=(4096, 256))
      P('fsdp', None)
    """

    __slots__ = ("gathered", "without")

    def __init__(self, rules: Rules, without: Rules, gathered: float):
        super().__init__(rules, strict=rules.strict)
        self.without = without
        self.gathered = gathered

    def spec(self, logical_axes, shape=None, mesh=None, path=None):
        axes = tuple(logical_axes) if not isinstance(logical_axes, str) else (logical_axes,)
        if shape is not None and "vocab" in axes and len(tuple(shape)) == len(axes):
            vocab = max(int(n) for n, name in zip(shape, axes, strict=True) if name == "vocab")
            if self.gathered > vocab:
                return self.without.spec(logical_axes, shape, mesh, path)
        return super().spec(logical_axes, shape, mesh, path)

    def __repr__(self) -> str:
        return f"VocabRules({list(self.pairs())!r}, vocab split while vocab > {self.gathered:g})"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A named sharding layout.

    Attributes:
      name: short name used on the command line (``dp``, ``fsdp``, ...).
      summary: one line for ``shardkit recipes``.
      mesh_axes: ordered ``(axis, size)`` pairs; one size may be ``-1`` (the rest
        of the devices).
      rules: logical → mesh rules for parameters (and gradients).
      activation_rules: logical → mesh rules for activations and the batch.
      optimizer_rules: rules for optimizer state; ``None`` means "as ``rules``"
        (ZeRO-1 shards only the optimizer state).
      attention: how attention handles a sharded sequence.
      collectives: the collective kinds the layout is meant to emit (its golden
        inventory); the report flags any other kind that moves real bytes. Default:
        derived from the rules (:func:`expected_collectives`); ``dataclasses.replace``
        keeps the set, ``collectives=None`` derives it again.
      optional_names: logical names the rules cover that a model may not have (the
        built-in recipes serve GPT and Llama, so ``kv_heads`` may match nothing); the
        report does not flag their rules as unused.
      attention_axis: the mesh axis ring/allgather/Ulysses attention splits the sequence
        over; for ``attention="usp"`` the pair ``(ulysses_axis, ring_axis)`` (heads
        exchanged over the first, K/V passed around the second; :attr:`context_axes`).
      layer_schedule: ``"gspmd"`` (XLA places the layers' collectives) or ``"tsp"``
        (the projections circulate weight shards over ``attention_axis``; see
        ``shardkit.nn.tsp``).
      logits: the logits' layout where an activation rule splits the vocabulary over a
        mesh axis that also splits the tokens (``"auto"``, ``"vocab"``, ``"tokens"``;
        see :meth:`step_activation_rules`). Recipes without such a rule ignore it.
      expert_dispatch: ``"gspmd"`` (XLA places a mixture-of-experts layer's collectives)
        or ``"alltoall"`` (all-to-alls over the mesh axis the rules put ``expert`` on;
        see ``shardkit.nn.moe``).
      balance: ``"zigzag"``: :meth:`shardkit.Plan.shard_batch` places every batch's
        tokens in the zigzag order over :attr:`balance_axis` with their positions
        (:mod:`shardkit.balance`), so causal attention's work is even across the ring's
        ranks and no layer reorders; ``"none"``: as given. Only the ring needs it (ring,
        usp): all-gather attention scores every local query against the whole sequence
        and Ulysses attends whole sequences, each as even as it comes;
        :meth:`with_attention` picks it (:data:`BALANCE_OF`).
      context_state: where a context-parallel recipe keeps the state: ``"sharded"``
        (parameters, gradients and optimizer state split over every axis that splits
        the batch or the sequence, ZeRO-3, weights gathered per layer) or
        ``"replicated"`` (whole over the context axis, gradients all-reduced); ``None``
        for a recipe without a context axis. Set by the rules; :meth:`with_context_state`
        changes both.
    """

    name: str
    summary: str
    mesh_axes: tuple[tuple[str, int], ...]
    rules: Rules
    activation_rules: Rules
    optimizer_rules: Rules | None = None
    attention: Literal["dense", "ring", "allgather", "ulysses", "usp"] = "dense"
    collectives: frozenset[str] | None = None
    optional_names: frozenset[str] = frozenset()
    attention_axis: str | tuple[str, str] = "sequence"
    layer_schedule: Literal["gspmd", "tsp"] = "gspmd"
    logits: LogitsLayout = "auto"
    expert_dispatch: Literal["gspmd", "alltoall"] = "gspmd"
    balance: Literal["none", "zigzag"] = "none"
    context_state: Literal["sharded", "replicated"] | None = None

    def __post_init__(self) -> None:
        if self.balance not in ("none", "zigzag"):
            raise ShardingError(
                f"Recipe {self.name!r}: balance is 'none' or 'zigzag', got {self.balance!r}."
            )
        if self.context_state not in (None, "sharded", "replicated"):
            raise ShardingError(
                f"Recipe {self.name!r}: context_state is 'sharded', 'replicated' or None, got "
                f"{self.context_state!r}.\nFix: recipe.with_context_state('replicated')."
            )
        if not isinstance(self.attention_axis, str):
            object.__setattr__(self, "attention_axis", tuple(self.attention_axis))
        pair = len(self.context_axes) > 1
        if (
            len(self.context_axes) > 2
            or (pair and self.attention not in ("usp", "dense"))
            or (not pair and self.attention == "usp")
        ):
            raise ShardingError(
                f"Recipe {self.name!r}: attention={self.attention!r} over attention_axis="
                f"{self.attention_axis!r}: 'usp' runs over a pair (ulysses_axis, ring_axis), "
                "ring, allgather and ulysses over one axis.\nFix: recipes.get('cp_usp') for "
                "USP, recipes.get('cp').with_attention(...) for the others."
            )
        if self.context_state is not None:
            on = {a for _, axes in self.rules for a in _as_tuple(axes)}
            if any((a in on) != (self.context_state == "sharded") for a in self.context_axes):
                raise ShardingError(
                    f"Recipe {self.name!r}: context_state={self.context_state!r}, but its "
                    f"parameter rules {list(self.rules.pairs())} "
                    f"{'do not split' if self.context_state == 'sharded' else 'split'} "
                    f"anything over {self.attention_axis!r}.\nFix: "
                    f"recipe.with_context_state({self.context_state!r}) rewrites the rules."
                )
        if self.collectives is None:
            object.__setattr__(self, "collectives", expected_collectives(self))
        else:
            object.__setattr__(self, "collectives", frozenset(self.collectives))
        if self.logits not in get_args(LogitsLayout):
            raise ShardingError(
                f"Recipe {self.name!r}: logits is one of {list(get_args(LogitsLayout))}, got "
                f"{self.logits!r}.\nFix: logits='auto' (the default) picks it per step."
            )

    @property
    def context_axes(self) -> tuple[str, ...]:
        """The mesh axes attention splits the sequence over: ``(attention_axis,)``, or
        USP's ``(ulysses_axis, ring_axis)``.

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("cp").context_axes, recipes.get("cp_usp").context_axes
          (('sequence',), ('ulysses', 'sequence'))
        """
        return context_axes(self.attention_axis)

    @property
    def balance_axis(self) -> str:
        """The axis whose ranks the load balance evens out: the ring's (USP's second
        axis; Ulysses attends its group's whole block), else :attr:`attention_axis`.

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("cp_usp").balance_axis
          'sequence'
        """
        return self.context_axes[-1]

    def axis_sizes(self, device_count: int) -> dict[str, int]:
        """Mesh axis sizes for ``device_count`` devices.

        Raises:
          MeshError: the sizes do not factor ``device_count``.
        """
        return resolve_axis_sizes(dict(self.mesh_axes), device_count)

    def parallelism(self, mesh: Mapping[str, int]) -> Parallelism:
        """The parallelism degrees this recipe runs on mesh axis sizes ``mesh``.

        Raises:
          ShardingError: ``mesh`` sizes an axis (> 1) that the recipe does not declare.

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("dp_tp_sp").parallelism({"data": 2, "tensor": 4})
          Parallelism(data=2, fsdp=1, tensor=4, sequence=1, data_kind='dp', tensor_kind='tp_sp', tsp=1, tsp_kind='gspmd', stage=1, expert=1)
          >>> recipes.get("zero1").parallelism({"data": 8}).data_kind
          'zero1'
        """
        declared = dict(self.mesh_axes)
        extra = {a: v for a, v in mesh.items() if declared and a not in declared and v != 1}
        if extra:
            raise ShardingError(
                f"Recipe {self.name!r} uses mesh axes {tuple(declared)}; mesh {dict(mesh)} also "
                f"sizes {extra}.\nFix: drop those axes or set them to 1."
            )
        degrees = {"data": 1, "fsdp": 1, "tensor": 1, "sequence": 1, "tsp": 1, "stage": 1}
        degrees["expert"] = 1
        kinds = {"data_kind": "dp", "tensor_kind": "tp", "tsp_kind": self.layer_schedule}
        for axis, size in mesh.items():
            role = self.axis_role(axis)
            if "expert" in _names_on(self.rules, axis):
                degrees["expert"] *= int(size)
            if role is None:
                continue
            if role == "tensor" and "length" in _names_on(self.activation_rules, axis):
                kinds["tensor_kind"] = "tp_sp"
            if role == "data" and _names_on(self.optimizer_rules, axis):
                kinds["data_kind"] = "zero1"
            degrees[role] *= int(size)
        return Parallelism(**degrees, **kinds)

    def axis_role(self, axis: str) -> str | None:
        """What mesh axis ``axis`` runs under this recipe's rules (never its name):
        ``"tensor"``, ``"stage"``, ``"tsp"``, ``"fsdp"``, ``"data"``, ``"sequence"``, or
        ``None`` for an axis no rule uses. The experts of an MoE layer (``expert``) do not
        decide it: an axis splitting them and the batch is ``"data"`` for the rest of the
        state (:attr:`Parallelism.expert` counts it).

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("dp_tp_sp").axis_role("tensor"), recipes.get("fsdp").axis_role("fsdp")
          ('tensor', 'fsdp')
        """
        params = _names_on(self.rules, axis) - {"expert"}
        acts = _names_on(self.activation_rules, axis)
        if params & _TENSOR_NAMES and "batch" not in acts:  # an axis splitting the batch
            return "tensor"  # and heads/MLP units is FSDP that also shards those
        if params == {"layers"}:
            return "stage"
        if params and "length" in acts:
            return "tsp"
        if params:
            return "fsdp"
        if "batch" in acts:
            return "data"
        if "length" in acts:
            return "sequence"
        return None

    def vocab_gather_axes(self, mesh: Mapping[str, int]) -> tuple[str, ...]:
        """Mesh axes (size > 1) that the activation rules put the vocabulary *and* the
        tokens on: a logits layout split there gathers every token of those devices.

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("fsdp").vocab_gather_axes({"fsdp": 8})
          ('fsdp',)
          >>> recipes.get("tp").vocab_gather_axes({"tensor": 4})   # tp does not split tokens
          ()
        """
        token_axes = {a for name in _TOKEN_NAMES for a in _axes_of(self.activation_rules, name)}
        return tuple(
            a
            for a in _axes_of(self.activation_rules, "vocab")
            if a in token_axes and mesh.get(a, 1) > 1
        )

    def step_activation_rules(
        self, mesh: Mapping[str, int], *, tokens: int | None = None, vocab: int | None = None
    ) -> Rules:
        """The activation rules a step of ``tokens`` tokens over a ``vocab`` vocabulary uses.

        A rule that splits the logits' vocabulary over a mesh axis that also splits the
        tokens (``fsdp``'s ``("vocab", "fsdp")``) makes each device gather the hidden
        states of every token of that axis's devices, ``T_g = tokens / (devices that
        split the tokens) × (those that also split the vocabulary)``, instead of the
        head's weight, ``vocab × d_model``: the hidden states and their gradient then
        cost ``T_g·d_model`` per device in memory and on the wire where the weight would
        cost ``vocab·d_model``. Under pure FSDP ``T_g`` is the step's global tokens,
        which grow with the device count at a fixed batch per device. So:

        - ``logits="vocab"``: the rules as written;
        - ``logits="tokens"``: without those vocabulary rules (the logits split over
          the tokens, the head's weight gathered once per step, as the layers' are);
        - ``logits="auto"``: ``"vocab"`` while ``T_g ≤ vocab``, else ``"tokens"``;
          the rules as written when ``tokens`` is unknown; with ``vocab`` unknown,
          a :class:`VocabRules` that decides for each array from its own ``vocab``
          dimension (what ``plan.jit`` uses: it knows the batch, not the model).

        Example:
          >>> from shardkit import recipes
          >>> fsdp = recipes.get("fsdp")
          >>> logits = ("batch", "length", "vocab")
          >>> fsdp.step_activation_rules({"fsdp": 8}, tokens=8 * 512, vocab=50304).spec(logits)
          P(None, None, 'fsdp')
          >>> fsdp.step_activation_rules({"fsdp": 64}, tokens=64 * 2048, vocab=50688).spec(logits)
          P('fsdp', None, None)
        """
        gather = self.vocab_gather_axes(mesh)
        if not gather or self.logits == "vocab" or (self.logits == "auto" and tokens is None):
            return self.activation_rules
        keep = [
            (name, axes)
            for name, axes in self.activation_rules
            if name != "vocab" or not set(_as_tuple(axes)) & set(gather)
        ]
        without = Rules(keep, strict=self.activation_rules.strict)
        if self.logits == "tokens":
            return without
        gathered = self.gathered_tokens(mesh, tokens)
        if vocab is None:  # decided per array, by its own vocabulary dimension
            return VocabRules(self.activation_rules, without, gathered)
        return self.activation_rules if gathered <= vocab else without

    def gathered_tokens(self, mesh: Mapping[str, int], tokens: int) -> float:
        """Tokens whose hidden states each device holds for a vocabulary-split head:
        ``tokens`` / (devices splitting the tokens) × (of those, the ones splitting the
        vocabulary too). See :meth:`step_activation_rules`.

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("fsdp").gathered_tokens({"fsdp": 512}, 512 * 2048)
          1048576.0
        """
        token_axes = {a for name in _TOKEN_NAMES for a in _axes_of(self.activation_rules, name)}
        split = math.prod(mesh.get(a, 1) for a in token_axes)
        return tokens / split * math.prod(mesh.get(a, 1) for a in self.vocab_gather_axes(mesh))

    def with_logits(self, layout: LogitsLayout) -> Recipe:
        """The same recipe with another logits layout (``"auto"``, ``"vocab"``, ``"tokens"``).

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("fsdp").with_logits("vocab").logits
          'vocab'
        """
        return dataclasses.replace(self, logits=layout)

    def with_attention(self, strategy: str, *, balance: str | None = None) -> Recipe:
        """The same recipe with another attention strategy over its context axis
        (``"ring"``, ``"allgather"``, ``"ulysses"``, ``"dense"``; ``"usp"`` on a recipe
        with two context axes, e.g. ``cp_usp``), its collectives derived again.

        ``balance``: the token order :meth:`shardkit.Plan.shard_batch` places; ``None``
        takes what the new strategy needs (:data:`BALANCE_OF`: the zigzag for the ring's
        causal load, none where attention's work is even as it comes, so no layer pays
        for gathering positions it does not need), unless this recipe's balance is not
        its current strategy's (a choice of the user's): that one is kept.

        Example:
          >>> from shardkit import recipes
          >>> ulysses = recipes.get("cp").with_attention("ulysses")
          >>> sorted(ulysses.collectives), ulysses.balance
          (['all-gather', 'all-reduce', 'all-to-all', 'reduce-scatter'], 'none')
          >>> ulysses.with_attention("ring").balance
          'zigzag'
          >>> recipes.get("cp").with_attention("allgather", balance="zigzag").balance
          'zigzag'
        """
        strategies = ("usp", "dense") if len(self.context_axes) > 1 else _ONE_AXIS
        if strategy not in strategies:
            other = (
                "recipes.get('cp') (one context axis)"
                if strategy in _ONE_AXIS
                else "recipes.get('cp_usp') (a Ulysses axis and a ring axis)"
            )
            raise ShardingError(
                f"Recipe {self.name!r} (context axes {self.context_axes}): attention is one "
                f"of {', '.join(strategies)}, got {strategy!r}.\nFix: one of those, or "
                f"{other}."
            )
        if balance is None:
            chose = self.balance != BALANCE_OF.get(self.attention, self.balance)
            balance = self.balance if chose else BALANCE_OF[strategy]
        return dataclasses.replace(self, attention=strategy, balance=balance, collectives=None)

    def with_context_state(self, state: Literal["sharded", "replicated"]) -> Recipe:
        """The same recipe with the state sharded over, or replicated across, the context
        axis: the parameter (and optimizer) rules of ``embed`` and ``vocab`` gain or lose
        ``attention_axis``, the collectives are derived again.

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("cp").rules.spec(("embed", "mlp"))
          P('sequence', None)
          >>> old = recipes.get("cp").with_context_state("replicated")
          >>> old.context_state, old.rules.spec(("embed", "mlp")), sorted(old.collectives)
          ('replicated', P(None, None), ['all-reduce', 'collective-permute'])
        """
        if state not in ("sharded", "replicated"):
            raise ShardingError(
                f"with_context_state takes 'sharded' or 'replicated', got {state!r}."
            )
        axes = self.context_axes
        whole = axes[0] if len(axes) == 1 else axes

        def rewrite(rules: Rules | None) -> Rules | None:
            if rules is None:
                return None
            pairs = []
            for name, entry in rules:
                kept = tuple(a for a in _as_tuple(entry) if a not in axes)
                if name in ("embed", "vocab") and state == "sharded":
                    kept = (*kept, *axes)
                pairs.append((name, kept[0] if len(kept) == 1 else kept or None))
            names = {name for name, _ in pairs}
            if state == "sharded":
                pairs += [(n, whole) for n in ("vocab", "embed") if n not in names]
            return Rules([(n, a) for n, a in pairs if a is not None], strict=rules.strict)

        return dataclasses.replace(
            self,
            rules=rewrite(self.rules),
            optimizer_rules=rewrite(self.optimizer_rules),
            context_state=state,
            collectives=None,
        )

    def with_latent(self, layout: Literal["heads", "split"]) -> Recipe:
        """The same recipe with multi-head latent attention's latents laid out another way
        (:mod:`shardkit.nn.mla`).

        ``"split"``: the K/V latent ``kv_latent`` (and the query latent ``q_latent``) split
        over the mesh axes ``heads`` is on, in the parameter, optimizer and activation
        rules: each device keeps ``1/t`` of the latent; the recipe is named
        ``<name>_latent``. The up-projections then contract the split latent: K and V are
        reduce-scattered onto the heads (all-gathered in the backward pass), so the recipe
        expects those collectives too. ``"heads"``: no latent rule (the heads split, the
        latent replicated: every built-in recipe's layout).

        Raises:
          ShardingError: an unknown layout, or ``"split"`` on a recipe whose rules put
            ``heads`` on no mesh axis.

        Example:
          >>> from shardkit import recipes
          >>> tp_latent = recipes.get("tp").with_latent("split")
          >>> tp_latent.name, tp_latent.rules.spec(("embed", "kv_latent"))
          ('tp_latent', P(None, 'tensor'))
          >>> tp_latent.with_latent("heads").rules == recipes.get("tp").rules
          True
        """
        if layout not in ("heads", "split"):
            raise ShardingError(
                f"Recipe {self.name!r}: with_latent takes 'heads' or 'split', got {layout!r}.\n"
                "Fix: with_latent('split') splits the latent over the heads' axis."
            )
        names = ("kv_latent", "q_latent")
        heads = _axes_of(self.rules, "heads")
        if layout == "split" and not heads:
            raise ShardingError(
                f"Recipe {self.name!r}: with_latent('split') splits the latent over the axes "
                f"the heads are on, but its rules put 'heads' on none ({list(self.rules.pairs())}"
                ").\nFix: start from a tensor-parallel recipe (tp, tp_sp, fsdp_tp, ep_tp)."
            )
        entry = heads[0] if len(heads) == 1 else tuple(heads)

        def rewrite(rules: Rules | None) -> Rules | None:
            if rules is None:
                return None
            kept = [(n, a) for n, a in rules if n not in names]
            added = [(n, entry) for n in names] if layout == "split" else []
            return Rules([*added, *kept], strict=rules.strict)

        base = self.name.removesuffix("_latent")
        had = any(n in names for n, _ in self.rules)
        if layout == "split":  # k/v reduce-scattered onto the heads, gathered backward
            collectives = self.collectives | {"reduce-scatter", "all-gather"}
        else:
            collectives = None if had else self.collectives
        return dataclasses.replace(
            self,
            name=f"{base}_latent" if layout == "split" else base,
            rules=rewrite(self.rules),
            optimizer_rules=rewrite(self.optimizer_rules),
            activation_rules=rewrite(self.activation_rules),
            optional_names=self.optional_names | set(names),
            collectives=collectives,
        )

    def with_mesh(self, axes: Mapping[str, int]) -> Recipe:
        """The same recipe on other mesh sizes (new axes go last).

        Example:
          >>> from shardkit import recipes
          >>> recipes.get("fsdp_tp").with_mesh({"tensor": 2}).axis_sizes(8)
          {'fsdp': 4, 'tensor': 2}
          >>> recipes.get("tp").with_mesh({"data": -1, "tensor": 4}).axis_sizes(8)
          {'tensor': 4, 'data': 2}
        """
        merged = dict(self.mesh_axes)
        merged.update(axes)
        return dataclasses.replace(self, mesh_axes=tuple(merged.items()))


#: What each role of a mesh axis (:meth:`Recipe.axis_role`) moves in a training step.
_ROLE_COLLECTIVES = {
    # the batch split, state whole: the gradients all-reduced
    "data": {"all-reduce"},
    # the state split: weights all-gathered where used, gradients reduce-scattered
    "fsdp": {"all-gather", "reduce-scatter"},
    # Megatron: the partial activations of row-parallel layers all-reduced
    "tensor": {"all-reduce"},
    # the sequence split, state whole: gradients all-reduced (attention adds its own)
    "sequence": {"all-reduce"},
    # state and sequence split: FSDP's gathers and scatters, the replicated leaves'
    # gradients all-reduced
    "tsp": {"all-gather", "reduce-scatter", "all-reduce"},
    # stages: activations passed on, the non-layer parameters' gradients all-reduced
    "stage": {"collective-permute", "all-reduce"},
}


def expected_collectives(recipe: Recipe) -> frozenset[str]:
    """The collective kinds ``recipe``'s rules imply, axis by axis (never its name).

    An axis that splits parameters (FSDP-like) expects all-gathers and
    reduce-scatters; one that splits only the batch, an all-reduce; a tensor axis
    (heads or MLP units split, the batch not) all-reduces, and adds reduce-scatters
    and all-gathers when it also splits the activations' ``length`` (sequence
    parallelism); a data axis that shards optimizer state (ZeRO-1) adds them too. Ring
    attention over a sequence axis permutes K/V blocks; all-gather attention gathers.

    Example:
      >>> from shardkit.rules import Rules
      >>> custom = Recipe("mine", "FSDP by a Flax rule list", (("data", 2), ("fsdp", -1)),
      ...                 Rules([("embed", "fsdp"), ("mlp", "fsdp")]),
      ...                 Rules([("batch", ("data", "fsdp"))]))
      >>> sorted(custom.collectives)
      ['all-gather', 'all-reduce', 'reduce-scatter']
    """
    axes = dict.fromkeys(a for a, _ in recipe.mesh_axes)
    for rules in (recipe.rules, recipe.activation_rules, recipe.optimizer_rules):
        axes.update(dict.fromkeys(sorted((rules or Rules([])).mesh_axis_names)))
    out: set[str] = set()
    for axis in axes:
        role = recipe.axis_role(axis)
        if role is None:
            continue
        out |= _ROLE_COLLECTIVES[role]
        if role == "tensor" and "length" in _names_on(recipe.activation_rules, axis):
            out |= {"reduce-scatter", "all-gather"}
        if role == "data" and _names_on(recipe.optimizer_rules, axis):
            out |= {"reduce-scatter", "all-gather"}
        if "expert" in _names_on(recipe.rules, axis):
            # the experts' tokens travel to them and back (shardkit.nn.moe); left to XLA
            # (expert_dispatch="gspmd") the tokens are gathered too
            out |= {"all-to-all"} | ({"all-gather"} if recipe.expert_dispatch == "gspmd" else set())
        if axis in recipe.context_axes and role in ("sequence", "tsp"):
            strategy = recipe.attention
            if strategy == "usp":  # heads exchanged over the first axis, the ring on the other
                strategy = "ulysses" if axis == recipe.context_axes[0] else "ring"
            out |= {
                "ring": {"collective-permute"},
                "allgather": {"all-gather"},
                "ulysses": {"all-to-all", "all-gather"},
            }.get(strategy, set())
    return frozenset(out or {"all-reduce"})
