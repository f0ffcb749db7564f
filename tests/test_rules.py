import math

import flax.linen as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit import errors
from shardkit.rules import axis_sizes_of

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


# -- exact texts and the data protocol (expected values written from the spec) -----------
def message(error, call, *args, **kwargs) -> str:
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    return str(info.value)


def test_axis_sizes_of_every_kind_of_mesh():
    mesh = sk.make_mesh({"data": 4, "tensor": 2})
    assert axis_sizes_of(mesh) == {"data": 4, "tensor": 2}
    assert axis_sizes_of(mesh.abstract_mesh) == {"data": 4, "tensor": 2}
    sizes = axis_sizes_of({"data": np.int64(8)})
    assert sizes == {"data": 8} and type(sizes["data"]) is int
    assert axis_sizes_of(None) == {}


def test_axis_sizes_of_bad_meshes():
    assert message(errors.ArgumentTypeError, axis_sizes_of, [("data", 8)]) == (
        "mesh is a Mesh, an AbstractMesh or a mapping {axis_name: size}, got list "
        "[('data', 8)].\nFix: mesh=sk.make_mesh({'data': -1}) or mesh={'data': 8}."
    )
    for name in ("", 3):
        assert message(errors.MeshError, axis_sizes_of, {"data": 2, name: 2}) == (
            f"mesh axis names are non-empty strings, got {name!r}."
        )
    for size in (0, True, 2.0, "2"):
        mesh = {"data": 2, "tensor": size}
        assert message(errors.MeshError, axis_sizes_of, mesh) == (
            f"mesh axis 'tensor' has size {size!r}; mesh sizes are positive integers "
            f"(mesh: {mesh}).\nFix: give 'tensor' a size of 1 or more."
        )


@pytest.mark.parametrize(
    "shape, text",
    [
        ("ab", "w: shape is a tuple of dimension sizes, got str 'ab'."),
        (8, "w: shape is a tuple of dimension sizes, got int 8."),
        ((4, 2.0), "w: shape (4, 2.0) holds 2.0; dimension sizes are integers."),
        ((4, True), "w: shape (4, True) holds True; dimension sizes are integers."),
    ],
)
def test_shapes_of_the_wrong_type(shape, text):
    call = sk.Rules([]).spec
    assert message(errors.ArgumentTypeError, call, (None, None), shape=shape, path="w") == text


def test_negative_dimension_and_numpy_dimensions():
    call = sk.Rules([]).spec
    assert message(errors.RankMismatchError, call, (None, None), shape=(4, -1), path="w") == (
        "w: shape (4, -1) has a negative dimension; sizes are >= 0."
    )
    rules = sk.Rules([("embed", "data")])
    assert rules.spec(("embed",), shape=[np.int64(8)], mesh={"data": 8}) == P("data")
    assert rules.spec(("embed",), shape=(0,), mesh={"data": 8}) == P("data")  # 0 divides


@pytest.mark.parametrize(
    "rule, text",
    [
        (
            ("embed",),
            "Rule #1 is ('embed',); each rule is a pair (logical_name, mesh_axes), e.g. "
            "('embed', 'fsdp'), ('batch', ('data', 'fsdp')) or ('heads', None).",
        ),
        (
            "embed",
            "Rule #1 is 'embed'; each rule is a pair (logical_name, mesh_axes), e.g. "
            "('embed', 'fsdp'), ('batch', ('data', 'fsdp')) or ('heads', None).",
        ),
        ((None, "data"), "Rule #1 (None, 'data'): the logical name must be a non-empty string."),
        (("", "data"), "Rule #1 ('', 'data'): the logical name must be a non-empty string."),
        (
            ("kv", 3),
            "Rule #1 ('kv', 3): mesh axes must be a mesh axis name, a tuple of names, or None, "
            "got int 3.\nFix: ('kv', 'data') or ('kv', ('data', 'fsdp')).",
        ),
        (
            ("kv", ("data", "")),
            "Rule #1 ('kv', ('data', '')): mesh axes must be a mesh axis name, a tuple of "
            "names, or None, got tuple ('data', '').\nFix: ('kv', 'data') or ('kv', ('data', "
            "'fsdp')).",
        ),
        (
            ("kv", ["data", "fsdp", "data", "fsdp"]),
            "Rule #1 ('kv', ['data', 'fsdp', 'data', 'fsdp']) names mesh axis 'data' twice; a "
            "mesh axis can shard one dimension only once.\nFix: ('kv', ('data', 'fsdp')).",
        ),
    ],
)
def test_malformed_rule_exact_text(rule, text):
    error = errors.DuplicateMeshAxisError if "twice" in text else errors.RuleError
    assert message(error, sk.Rules, [("batch", "data"), rule]) == text


def test_rules_of_the_wrong_type():
    for bad in ("embed", 3):
        assert message(errors.RuleError, sk.Rules, bad) == (
            f"Rules takes a list of (logical, mesh_axes) pairs, got {bad!r}."
        )


def test_list_mesh_axes_are_a_tuple_and_one_axis_is_a_string():
    rules = sk.Rules([["batch", ["data", "fsdp"]], ("embed", ("tensor",)), ("kv", None)])
    assert rules.pairs() == (("batch", ("data", "fsdp")), ("embed", "tensor"), ("kv", None))
    assert list(rules) == list(rules.pairs()) and len(rules) == 3
    assert rules.logical_names == frozenset({"batch", "embed", "kv"})
    assert rules.mesh_axis_names == frozenset({"data", "fsdp", "tensor"})


def test_adding_rules_keeps_strictness_and_order():
    strict = sk.Rules([("embed", "fsdp")], strict=True)
    both = strict + sk.Rules([("mlp", "tensor")])
    assert both.strict is True and both.pairs() == (("embed", "fsdp"), ("mlp", "tensor"))
    assert (sk.Rules([("a", None)]) + [("b", "x")]).strict is False


def test_equal_rules_hash_equal_and_differ_from_other_rules():
    a, b = sk.Rules([("embed", "fsdp")]), sk.Rules([("embed", ("fsdp",))])
    assert a == b and hash(a) == hash(b)
    assert hash(a) != hash(sk.Rules([("embed", "tensor")]))
    assert hash(a) != hash(sk.Rules([("embed", "fsdp")], strict=True))
    assert a != [("embed", "fsdp")]
    assert len({a, b, sk.Rules([("embed", "tensor")])}) == 2


def test_repr_round_trips():
    assert repr(sk.Rules([("embed", "fsdp"), ("kv", None)])) == (
        "Rules([('embed', 'fsdp'), ('kv', None)])"
    )
    assert repr(sk.Rules([("b", ("data", "fsdp"))], strict=True)) == (
        "Rules([('b', ('data', 'fsdp'))], strict=True)"
    )


def test_validate_exact_text_and_a_mesh_object():
    rules = sk.Rules([("batch", "data"), ("embed", ("fsdp", "model"))])
    assert rules.validate(sk.make_mesh({"data": 2, "fsdp": 2, "model": 2})) is None
    assert message(errors.UnknownMeshAxisError, rules.validate, {"data": 4, "fsdp": 2}) == (
        "Rule ('embed', 'model') names mesh axis 'model', but the mesh has axes "
        "{'data': 4, 'fsdp': 2}.\nFix: rename it to one of ['data', 'fsdp'], or add 'model' "
        "to the mesh (size 1 is allowed)."
    )
    with pytest.raises(errors.ArgumentTypeError):
        rules.validate("data")


def test_spec_argument_errors_exact_text():
    rules = sk.Rules([("batch", "data")])
    assert message(errors.ArgumentTypeError, rules.spec, {"batch"}, path="x") == (
        "x: logical axes are a tuple of names (or None), one per dimension, got set "
        "{'batch'}.\nFix: e.g. ('batch', 'embed')."
    )
    assert message(errors.RuleError, rules.spec, "batch", path="x") == (
        "x: logical axes must be a tuple of names (or None), one per dimension, got "
        "'batch'.\nFix: write ('batch',) for one dimension."
    )
    assert message(errors.RuleError, rules.spec, ["batch", ""], path="x") == (
        "x: logical axes ('batch', '') may only hold names or None."
    )
    more = ("batch", None, None)
    assert message(errors.RankMismatchError, rules.spec, more, shape=(4, 8), path="x") == (
        "x: shape (4, 8) has 2 dimension(s) but logical axes ('batch', None, None) name 3.\n"
        "Fix: give one logical name (or None) per dimension in the annotation of this "
        "parameter, at most."
    )
    assert rules.spec(["batch", None]) == P("data", None)  # a list is as good as a tuple


def test_strict_rules_exact_text_with_and_without_shape():
    rules = sk.Rules([("embed", "fsdp")], strict=True)
    assert rules.spec(("embed", None)) == P("fsdp", None)  # None needs no rule
    assert message(
        errors.UnknownLogicalAxisError, rules.spec, ("embed", "mlp", "kv"), path="d/k"
    ) == (
        "d/k: logical axis 'mlp' (axes ('embed', 'mlp', 'kv')) has no rule and the rules are "
        "strict.\nFix: add ('mlp', None) to replicate it, or ('mlp', '<mesh axis>') to "
        "shard it."
    )
    text = message(errors.UnknownLogicalAxisError, rules.spec, ("mlp",), shape=(4,), path="k")
    assert text.startswith("k: logical axis 'mlp' (axes ('mlp',), shape (4,)) has no rule")


def test_unknown_mesh_axis_in_spec_exact_text():
    rules = sk.Rules([("embed", ("data", "model"))])
    text = message(errors.UnknownMeshAxisError, rules.spec, (None, "embed"), mesh={"data": 2})
    assert text == (
        "<array>: logical axis 'embed' maps to mesh axis 'model', but the mesh has axes "
        "{'data': 2}.\nFix: map 'embed' to one of ['data'] in the rules, or add 'model' to "
        "the mesh."
    )


def test_size_one_axes_drop_out_of_a_tuple_and_a_used_axis_stays_used():
    rules = sk.Rules([("batch", ("data", "fsdp")), ("embed", "fsdp"), ("embed", "tensor")])
    mesh = {"data": 2, "fsdp": 1, "tensor": 4}
    # fsdp has size 1: batch keeps data alone, and embed still falls through to tensor
    # (batch claimed fsdp before the size-1 axes were dropped).
    assert rules.spec(("batch", "embed"), shape=(4, 8), mesh=mesh) == P("data", "tensor")
    assert rules.spec(("batch",), mesh={"data": 1, "fsdp": 1, "tensor": 4}) == P(None)
    # embed alone takes its first rule (fsdp, free), which size 1 then drops: replicated,
    # not moved on to tensor (4 would not divide 6 anyway).
    assert rules.spec(("embed",), shape=(6,), mesh={"data": 2, "fsdp": 1, "tensor": 4}) == (P(None))


def test_without_a_mesh_nothing_is_dropped_or_checked():
    rules = sk.Rules([("embed", ("fsdp", "tensor"))])
    assert rules.spec(("embed",), shape=(3,)) == P(("fsdp", "tensor"))


@pytest.mark.parametrize(
    "size, mesh, fix",
    [
        # 12 over 8: 2 and 4 divide both 12 and the 8 devices
        (12, {"tensor": 8}, "use tensor 2 or 4, or make 'heads' a multiple of 8 (e.g. 16)"),
        # 6 over 4 (of 8 devices): only 2 fits
        (6, {"tensor": 4, "data": 2}, "use tensor 2, or make 'heads' a multiple of 4 (e.g. 8)"),
        # 5 over 4: no size in between divides 5
        (5, {"tensor": 4, "data": 2}, "make 'heads' a multiple of 4 (e.g. 8)"),
        # 36 over 16: of 36's divisors below 16 (2, 3, 4, 6, 9, 12), 2 and 4 divide 16
        (36, {"tensor": 16}, "use tensor 2 or 4, or make 'heads' a multiple of 16 (e.g. 48)"),
        # 24 over 32: of 24's divisors below 32 (2, 3, 4, 6, 8, 12, 24), 2, 4, 8 divide 32
        (24, {"tensor": 32}, "use tensor 2, 4 or 8, or make 'heads' a multiple of 32 (e.g. 32)"),
    ],
)
def test_indivisible_fix_lists_the_sizes_that_would_fit(size, mesh, fix):
    rules = sk.Rules([("heads", "tensor")])
    text = message(errors.IndivisibleError, rules.spec, ("heads",), shape=(size,), mesh=mesh)
    over = f"tensor={mesh['tensor']}"
    assert text == (
        f"<array>: shape ({size},), dimension 0 ('heads') has size {size}, which {over} does "
        f"not divide (mesh axis sizes: {mesh}).\nFix: {fix}, or map 'heads' to other mesh "
        "axes (or None) in the rules."
    )


def test_indivisible_over_two_mesh_axes_names_both():
    rules = sk.Rules([("batch", ("data", "fsdp"))])
    mesh = {"data": 2, "fsdp": 4}
    text = message(errors.IndivisibleError, rules.spec, (None, "batch"), (3, 12), mesh, "b")
    assert text == (
        "b: shape (3, 12), dimension 1 ('batch') has size 12, which data=2 × fsdp=4 does not "
        "divide (mesh axis sizes: {'data': 2, 'fsdp': 4}).\nFix: use data×fsdp 2 or 4, or "
        "make 'batch' a multiple of 8 (e.g. 16), or map 'batch' to other mesh axes (or "
        "None) in the rules."
    )


def test_a_mesh_without_a_shape_fits_the_axes_but_checks_no_divisibility():
    rules = sk.Rules([("batch", ("data", "fsdp")), ("embed", "tensor")])
    mesh = {"data": 4, "fsdp": 1, "tensor": 2}
    assert rules.spec(("batch", None, "embed"), mesh=mesh) == P("data", None, "tensor")
