"""A recipe's expected collectives, derived from its rules (``expected_collectives``)."""

import dataclasses

import pytest

import shardkit as sk
from shardkit.recipes import Recipe
from shardkit.recipes.recipe import expected_collectives

AG, RS, AR, CP = "all-gather", "reduce-scatter", "all-reduce", "collective-permute"


@pytest.mark.parametrize("name", sk.recipes.names())
def test_derived_from_the_rules_equals_each_catalogue_recipes_declared_set(name):
    recipe = sk.recipes.get(name)
    # The catalogue writes its sets by hand (the golden inventory of each layout).
    assert expected_collectives(recipe) == recipe.collectives
    assert dataclasses.replace(recipe, collectives=None).collectives == recipe.collectives


def custom(rules, activations, mesh_axes, **kw):
    return Recipe(
        "custom", "a user's rules", mesh_axes, sk.Rules(rules), sk.Rules(activations), **kw
    )


@pytest.mark.parametrize(
    "rules, activations, mesh_axes, kw, want",
    [
        # an axis that splits parameters (and the batch): FSDP's gathers and scatters
        ([("embed", "fsdp")], [("batch", "fsdp")], (("fsdp", -1),), {}, {AG, RS}),
        # one that splits only the batch: an all-reduce
        ([], [("batch", "data")], (("data", -1),), {}, {AR}),
        # HSDP from one Flax-style list: both
        (
            [("embed", "fsdp"), ("mlp", "fsdp")],
            [("batch", ("data", "fsdp"))],
            (("data", 2), ("fsdp", -1)),
            {},
            {AG, RS, AR},
        ),
        # heads split, batch whole: Megatron's all-reduces; with the length split too, SP
        ([("heads", "model")], [("heads", "model")], (("model", -1),), {}, {AR}),
        ([("heads", "model")], [("length", "model")], (("model", -1),), {}, {AR, RS, AG}),
        # the sequence split with ring attention, or all-gather attention
        ([], [("length", "seq")], (("seq", -1),), {"attention_axis": "seq"}, {AR}),
        (
            [],
            [("length", "seq")],
            (("seq", -1),),
            {"attention_axis": "seq", "attention": "ring"},
            {AR, CP},
        ),
        (
            [],
            [("length", "seq")],
            (("seq", -1),),
            {"attention_axis": "seq", "attention": "allgather"},
            {AR, AG},
        ),
        # ZeRO-1: the optimizer state split over the data axis
        (
            [],
            [("batch", "data")],
            (("data", -1),),
            {"optimizer_rules": sk.Rules([("embed", "data")])},
            {AR, RS, AG},
        ),
        # stages of a layer stack
        ([("layers", "stage")], [], (("stage", -1),), {}, {CP, AR}),
    ],
)
def test_a_custom_recipe_expects_what_its_rules_imply(rules, activations, mesh_axes, kw, want):
    assert custom(rules, activations, mesh_axes, **kw).collectives == want


def test_the_derived_set_is_overridable():
    recipe = custom([("embed", "fsdp")], [("batch", "fsdp")], (("fsdp", -1),), collectives={AR})
    assert recipe.collectives == frozenset({AR})
