import math

import flax.linen as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit import errors

MAXTEXT_STYLE = [
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("embed", "tensor"),
    ("vocab", "tensor"),
]


def test_first_match_wins():
    rules = sk.Rules([("embed", "fsdp"), ("embed", "tensor")])
    assert rules.spec(("embed",)) == P("fsdp")


def test_used_axis_falls_through_to_next_rule():
    rules = sk.Rules(MAXTEXT_STYLE)
    # embed cannot take fsdp (batch holds it), so it takes its second rule.
    assert rules.spec(("batch", "embed")) == P(("data", "fsdp"), "tensor")
    assert rules.spec(("embed", "mlp")) == P("fsdp", "tensor")


def test_rule_order_not_dimension_order_decides():
    # Flax linen semantics: earlier rules claim axes first.
    rules = sk.Rules([("embed", "fsdp"), ("mlp", "fsdp"), ("mlp", "tensor")])
    assert rules.spec(("mlp", "embed")) == P("tensor", "fsdp")


def test_none_rule_replicates_and_unknown_name_replicates():
    rules = sk.Rules([("heads", None), ("heads", "tensor")])
    assert rules.spec(("heads", "nobody", None)) == P(None, None, None)


def test_size_one_mesh_axes_are_dropped():
    rules = sk.Rules(MAXTEXT_STYLE)
    mesh = {"data": 8, "fsdp": 1, "tensor": 1}
    assert rules.spec(("batch", "embed"), shape=(16, 4), mesh=mesh) == P("data", None)


def test_strict_rules_reject_names_without_a_rule():
    rules = sk.Rules([("embed", "fsdp")], strict=True)
    with pytest.raises(
        errors.UnknownLogicalAxisError, match=r"(?s)'mlp'.*no rule.*\('mlp', None\)"
    ):
        rules.spec(("embed", "mlp"), path="dense/kernel")


def test_unknown_mesh_axis_names_the_axis_and_mesh():
    rules = sk.Rules([("embed", "model")])
    with pytest.raises(errors.UnknownMeshAxisError, match=r"'model'.*\{'data': 8\}"):
        rules.spec(("embed",), shape=(8,), mesh={"data": 8}, path="w")
    with pytest.raises(errors.UnknownMeshAxisError):
        rules.validate({"data": 8})


def test_duplicate_axis_in_one_rule():
    with pytest.raises(errors.DuplicateMeshAxisError, match="twice"):
        sk.Rules([("batch", ("data", "data"))])


@pytest.mark.parametrize(
    "bad", [[("embed",)], [("embed", 3)], [(None, "data")], "embed", [("x", ("a", 1))]]
)
def test_malformed_rules(bad):
    with pytest.raises(errors.RuleError):
        sk.Rules(bad)


def test_rank_mismatch_names_path():
    with pytest.raises(errors.RankMismatchError, match=r"layers/w: shape \(4, 8\) has 2"):
        sk.Rules([]).spec(("embed", "mlp", "heads"), shape=(4, 8), path="layers/w")


def test_fewer_names_than_dimensions_are_a_prefix_as_in_flax():
    rules = [("embed", "fsdp"), ("kv", None), ("heads", "tensor")]
    mesh = {"fsdp": 2, "tensor": 2}
    for names in [("embed", "kv"), ("heads",), ("kv", "embed"), ()]:
        want = nn.logical_to_mesh_axes(names, rules)  # Flax's resolver, on the names alone
        got = sk.Rules(rules).spec(names, shape=(8, 4, 2), mesh=mesh)
        assert tuple(got) == (*want, *[None] * (3 - len(want))), names


def test_indivisible_error_exact_text():
    rules = sk.Rules([("heads", "tensor")])
    with pytest.raises(errors.IndivisibleError) as info:
        rules.spec(
            ("embed", "heads", "kv"),
            shape=(768, 12, 64),
            mesh={"data": 1, "tensor": 8},
            path="params/layers/attn/query/kernel",
        )
    assert str(info.value) == (
        "params/layers/attn/query/kernel: shape (768, 12, 64), dimension 1 ('heads') has "
        "size 12, which tensor=8 does not divide (mesh axis sizes: {'data': 1, 'tensor': 8}).\n"
        "Fix: use tensor 2 or 4, or make 'heads' a multiple of 8 (e.g. 16), or map "
        "'heads' to other mesh axes (or None) in the rules."
    )


def test_rules_are_comparable_data_in_flax_format():
    a = sk.Rules(MAXTEXT_STYLE)
    assert a == sk.Rules(list(a)) and hash(a) == hash(sk.Rules(MAXTEXT_STYLE))
    assert list(a)[0] == ("batch", ("data", "fsdp"))
    assert list(a)[1] == ("embed", "fsdp")
    assert len(a + [("kv", None)]) == len(a) + 1
    assert a != sk.Rules(MAXTEXT_STYLE, strict=True)


# -- property: every call returns a valid spec or raises ShardingError ---------------
LOGICAL = ["batch", "embed", "mlp", "heads", "vocab", None]
MESH_AXES = ["data", "fsdp", "tensor", "seq"]

mesh_axes_value = st.one_of(
    st.none(),
    st.sampled_from(MESH_AXES + ["bogus"]),
    st.lists(st.sampled_from(MESH_AXES), min_size=1, max_size=3).map(tuple),
)
rule_lists = st.lists(
    st.tuples(st.sampled_from([n for n in LOGICAL if n]), mesh_axes_value), max_size=8
)
meshes = st.dictionaries(st.sampled_from(MESH_AXES), st.sampled_from([1, 2, 3, 4, 8]), min_size=1)


@settings(max_examples=400, deadline=None)
@given(
    rules=rule_lists,
    logical=st.lists(st.sampled_from(LOGICAL), min_size=0, max_size=4),
    dims=st.lists(st.integers(1, 64), min_size=4, max_size=4),
    mesh=meshes,
    strict=st.booleans(),
)
def test_spec_is_valid_or_sharding_error(rules, logical, dims, mesh, strict):
    shape = tuple(dims[: len(logical)])
    try:
        spec = sk.Rules(rules, strict=strict).spec(tuple(logical), shape=shape, mesh=mesh)
    except sk.ShardingError:
        return
    assert isinstance(spec, P) and len(spec) == len(shape)
    seen = []
    for size, entry in zip(shape, spec, strict=False):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        assert all(a in mesh and mesh[a] > 1 for a in axes)
        seen.extend(axes)
        assert size % math.prod(mesh[a] for a in axes) == 0
    assert len(seen) == len(set(seen))


def test_string_instead_of_tuple_is_a_clear_error():
    with pytest.raises(errors.RuleError, match=r"\('batch',\)"):
        sk.Rules([("batch", "data")]).spec("batch")
    with pytest.raises(errors.RuleError):
        sk.Rules([]).spec((3, None))
