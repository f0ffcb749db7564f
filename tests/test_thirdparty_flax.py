"""A linen model annotated the Flax way, as Flax resolves it, under shardkit's recipes.

Built from Flax's own ``nn.MultiHeadDotProductAttention`` and ``nn.DenseGeneral`` with
``nn.with_logical_partitioning`` (its attention kernels are 3-D with 2 logical names): on
8 devices it trains to the 1-device losses, every parameter laid out as
``nn.logical_to_mesh_axes`` predicts with the recipe's rules, and ``build_report`` reads
it. A custom FSDP recipe from a Flax rule list expects its weight gathers. The NNX
model is in ``test_thirdparty_nnx.py``; see ``flax_training.py``.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax_training import B, S, check_trains_as_flax_lays_it_out, init_fn, step_fn

import shardkit as sk
from shardkit.recipes import Recipe
from shardkit.report import build_report


@pytest.mark.parametrize("recipe", ["dp", "fsdp", "tp", "fsdp_tp"])
def test_a_linen_model_of_flax_attention_trains_as_flax_lays_it_out(recipe):
    check_trains_as_flax_lays_it_out("linen", recipe)


#: FSDP as a Flax user writes it: one rule list for parameters and activations.
FLAX_FSDP_RULES = [
    ("batch", "fsdp"),
    ("embed", "fsdp"),
    ("length", None),
    ("kv", None),
    ("mlp", None),
    ("vocab", None),
]


def test_a_custom_fsdp_recipe_from_a_flax_rule_list_expects_its_weight_gathers():
    rules = sk.Rules(FLAX_FSDP_RULES)
    recipe = Recipe("my_fsdp", "FSDP from a Flax rule list", (("fsdp", -1),), rules, rules)
    plan = sk.Plan(recipe)
    abstract = plan.abstract_init(init_fn("linen"), jax.random.key(0))
    batch = {k: jax.ShapeDtypeStruct((B, S), np.int32) for k in ("inputs", "targets")}
    compiled = plan.compile(step_fn("linen"), abstract, batch)
    report = build_report(plan, compiled, abstract)
    assert {c.kind for c in report.collectives} >= {"all-gather", "reduce-scatter"}
    assert not [w for w in report.warnings if "unexpected" in w], report.warnings
    # The old default ({"all-reduce"}) called the weight gathers unexpected.
    old = sk.Plan(dataclasses.replace(recipe, collectives=frozenset({"all-reduce"})), plan.mesh)
    assert any(
        w.startswith("unexpected all-gather")
        for w in build_report(old, compiled, abstract).warnings
    )
