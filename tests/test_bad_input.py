"""Property test of the public surface: any input gives a result or a ``ShardingError``.

Malformed arguments of every kind (wrong types, sizes of 0 or below, duplicates,
bytes patterns, strings where tuples belong, dicts where meshes belong, ...) must end
in a ``ShardingError`` whose message names the offending argument — never a raw
``AttributeError``/``TypeError``/``IndexError`` from deep inside shardkit or JAX.
Derandomized, so CI sees the same examples every run: 1,300 per target, more than 10,000
calls over all targets (the last test counts them); ``SHARDKIT_FUZZ_EXAMPLES=200`` for a
quick run.
"""

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardkit as sk

#: Examples per target: the suite's profile, or the big run's.
EXAMPLES = int(os.environ.get("SHARDKIT_FUZZ_EXAMPLES", "1300"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

NAMES = ["batch", "embed", "mlp", "heads", "vocab", "length", "data", "fsdp", "tensor", ""]
MESH_AXES = ["data", "fsdp", "tensor", "sequence", "nope"]

# Junk of every kind, mixed into well-formed values so the deep code is reached too.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 16),
    st.floats(-2, 9),
    st.just(float("nan")),
    st.sampled_from(NAMES + MESH_AXES),
    st.binary(max_size=4),
    st.text(max_size=4),
)
junk = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), inner, max_size=3),
    ),
    max_leaves=8,
)
names = st.one_of(st.sampled_from(NAMES), st.none(), scalars)
logical = st.one_of(st.lists(names, max_size=4).map(tuple), junk)
shapes = st.one_of(st.lists(st.integers(-3, 24), max_size=4).map(tuple), junk)
sizes = st.one_of(st.integers(-5, 9), st.sampled_from([-1, 1, 2, 4, 8]), scalars)
axis_dicts = st.one_of(st.dictionaries(st.sampled_from(MESH_AXES), sizes, max_size=3), junk)
rules = st.one_of(
    st.lists(
        st.tuples(
            names,
            st.one_of(
                st.sampled_from(MESH_AXES),
                st.none(),
                st.lists(st.sampled_from(MESH_AXES), max_size=2).map(tuple),
                scalars,
            ),
        ),
        max_size=4,
    ),
    junk,
)
DEVICES = jax.devices()
devices = st.one_of(
    st.none(),
    st.lists(st.sampled_from(DEVICES), max_size=8),
    st.lists(st.sampled_from(DEVICES), min_size=1, max_size=8, unique=True),
    junk,
)
patterns = st.one_of(
    st.lists(
        st.tuples(st.one_of(st.sampled_from(["kernel$", "bias", "(", "a/b", ""]), junk), logical),
        max_size=3,
    ),
    junk,
)
policies = st.one_of(st.sampled_from(["replicate", "error", None]), junk)


CALLS: dict[str, int] = {}


def outcome(fn, *words):
    """Call ``fn``; a ShardingError must mention one of ``words`` (the argument)."""
    target = sys._getframe(1).f_code.co_name
    CALLS[target] = CALLS.get(target, 0) + 1
    try:
        fn()
    except sk.ShardingError as e:
        message = str(e)
        assert any(w in message for w in words), f"{type(e).__name__}: {message}"


@SETTINGS
@given(rules, st.booleans())
def test_rules(pairs, strict):
    outcome(lambda: sk.Rules(pairs, strict=strict), "Rule", "rule", "mesh axis")


@SETTINGS
@given(logical, shapes, axis_dicts, junk)
def test_rules_spec(axes, shape, mesh, path):
    r = sk.Rules([("batch", "data"), ("embed", "fsdp"), ("mlp", ("tensor", "data"))])
    outcome(
        lambda: r.spec(axes, shape=shape, mesh=mesh, path=path),
        "logical",
        "shape",
        "mesh",
        "dimension",
        "rule",
    )


@SETTINGS
@given(axis_dicts, devices, st.one_of(st.booleans(), junk), st.one_of(st.none(), axis_dicts))
def test_make_mesh(axes, devs, explicit, dcn):
    outcome(
        lambda: sk.make_mesh(axes, devices=devs, explicit=explicit, dcn=dcn),
        "Mesh",
        "mesh",
        "axes",
        "devices",
        "dcn",
        "explicit",
        "device count",
    )


TREE = {"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}, "step": np.zeros(())}


@SETTINGS
@given(patterns, policies)
def test_path_axes(pairs, policy):
    def use():
        pa = sk.PathAxes(pairs, on_unmatched=policy)
        sk.logical_axes(TREE, annotations=pa)

    outcome(use, "Annotation", "annotation", "PathAxes", "on_unmatched", "dense/", "pattern")


@SETTINGS
@given(patterns, st.sampled_from(["linen", "nnx", "other"]))
def test_axes_decorator(pairs, kind):
    def use():
        decorate = sk.axes(pairs)
        if kind == "other":
            return decorate(len)

        class M(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(8)(x)

        params = jax.eval_shape(decorate(M)().init, jax.random.key(0), jnp.ones((1, 4)))
        sk.logical_axes(params)

    outcome(use, "Annotation", "annotation", "PathAxes", "sk.axes", "Dense_0", "pattern")


MESH = sk.make_mesh({"data": 2, "tensor": 4})
EXPLICIT = sk.make_mesh({"data": 2, "tensor": 4}, explicit=True)


@SETTINGS
@given(st.one_of(shapes, st.just((8, 4))), logical, st.booleans(), rules)
def test_constrain(shape, axes, with_mesh, pairs):
    def use():
        valid = isinstance(shape, tuple) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        )
        x = jax.ShapeDtypeStruct(shape, jnp.float32) if valid else shape  # junk as it is
        if not with_mesh:
            return sk.constrain(x, axes)
        with jax.set_mesh(MESH):
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.eval_shape(lambda a: sk.constrain(a, axes, rules=pairs), x)
            return sk.constrain(x, axes, rules=pairs)

    outcome(use, "constrain", "logical", "shape", "Rule", "mesh", "dimension")


OTHER_MESH = sk.make_mesh({"x": 8})
#: Eager arrays of every kind of sharding: on one device (any), on another mesh, host.
eager_arrays = st.one_of(
    st.tuples(st.sampled_from(DEVICES), st.sampled_from([(8, 4), (8,), (3, 5), ()])).map(
        lambda d: jax.device_put(np.ones(d[1], np.float32), d[0])
    ),
    st.sampled_from([(8, 4), (16,), (8, 2, 2)]).map(
        lambda s: jax.device_put(
            np.ones(s, np.float32), jax.sharding.NamedSharding(OTHER_MESH, jax.P("x"))
        )
    ),
    st.sampled_from([(8, 4), (7,)]).map(lambda s: np.ones(s, np.float32)),
)


@SETTINGS
@given(eager_arrays, logical, st.sampled_from(["none", "mesh", "explicit", "abstract"]), rules)
def test_constrain_eager(x, axes, where, pairs):
    """``sk.constrain`` outside jit, on arrays whose sharding is not the mesh's."""

    def use():
        if where == "none":
            return sk.constrain(x, axes, rules=pairs)
        if where == "abstract":
            with jax.sharding.use_abstract_mesh(MESH.abstract_mesh):
                return sk.constrain(x, axes, rules=pairs)
        with jax.set_mesh(EXPLICIT if where == "explicit" else MESH):
            y = sk.constrain(x, axes, rules=pairs)
        if pairs is None:  # no rules given and none active: unchanged, as documented
            assert y is x
        else:
            assert isinstance(y.sharding, jax.sharding.NamedSharding) and y.shape == np.shape(x)
        return y

    outcome(use, "constrain", "logical", "shape", "Rule", "mesh", "dimension")


@SETTINGS
@given(
    st.one_of(st.sampled_from(sk.recipes.names() + ["ddp"]), rules, junk),
    st.one_of(st.none(), st.just(MESH), axis_dicts),
    devices,
    patterns,
    policies,
)
def test_plan(recipe, mesh, devs, annotations, policy):
    outcome(
        lambda: sk.Plan(recipe, mesh, devices=devs, annotations=annotations, on_unmatched=policy),
        "Plan",
        "recipe",
        "Rule",
        "mesh",
        "devices",
        "Annotation",
        "annotation",
        "on_unmatched",
        "Mesh",
        "axes",
        "PathAxes",
        "pattern",
    )


def test_the_targets_drew_their_examples():
    """Counts the calls the targets above really made (pytest runs a file in order, and
    the README's ``--dist loadfile`` keeps a file on one xdist worker): at least 10,000
    in the big run (``SHARDKIT_FUZZ_EXAMPLES`` >= 1300)."""
    if len(CALLS) < 8:
        pytest.skip("run with the whole file: counts the calls of every target above")
    want = 10_000 if EXAMPLES >= 1300 else 8 * EXAMPLES // 2  # some spaces are small
    assert sum(CALLS.values()) >= want, CALLS


@pytest.mark.parametrize(
    "call, kind, message",
    [
        (lambda: sk.Plan(None), TypeError, "Plan takes a recipe name"),
        (lambda: sk.make_mesh([("data", 8)]), TypeError, "Fix: pass dict([('data', 8)])"),
        (lambda: sk.make_mesh({"data": -1}, devices=[]), ValueError, "devices is empty"),
        (lambda: sk.Rules([("e", "d")]).spec(("e",), shape=(7.5,)), TypeError, "holds 7.5"),
        (lambda: sk.Rules([]).spec(None), TypeError, "logical axes are a tuple"),
        (lambda: sk.PathAxes([(b"kernel", ("embed",))]), TypeError, "patterns are regexes"),
        (lambda: sk.PathAxes("kernel$"), TypeError, "got str 'kernel$'"),
        (lambda: sk.constrain(jnp.ones(5), "batch"), TypeError, "Fix: e.g. ('batch',)"),
        (lambda: sk.Rules([("e", "d")]).spec(("e",), mesh={"d": 0}), ValueError, "size 0"),
        (lambda: sk.Rules([("e", "d")]).spec(("e",), (-8,), {"d": 2}), ValueError, "negative"),
        (lambda: sk.Plan("fsdp", devices=jax.devices()[:4] * 2), ValueError, "more than once"),
        (lambda: sk.Plan("fsdp", {"fsdp": 8}), TypeError, "sk.make_mesh({'fsdp': 8})"),
        (lambda: sk.Plan("fsdp", on_unmatched="foo"), ValueError, "'replicate' or 'error'"),
    ],
)
def test_each_reported_case_names_its_fix(call, kind, message):
    # The cases a fuzz of the public API found; each also keeps the builtin it is.
    with pytest.raises(sk.ShardingError, match=None) as e:
        call()
    assert isinstance(e.value, kind) and message in str(e.value)


def test_constrain_outside_jit_places_an_array_of_any_sharding():
    """The fuzz's raw ``TypeError``/``ValueError`` from ``with_sharding_constraint``: an
    eager array on one device, or on another mesh, under ``jax.set_mesh``."""
    rules = [("batch", "data"), ("embed", "tensor")]
    for x in (
        jax.device_put(np.arange(32.0).reshape(8, 4), DEVICES[3]),
        jax.device_put(
            np.arange(32.0).reshape(8, 4), jax.sharding.NamedSharding(OTHER_MESH, jax.P("x"))
        ),
    ):
        for mesh in (MESH, EXPLICIT):
            with jax.set_mesh(mesh):
                y = sk.constrain(x, ("batch", "embed"), rules=rules)
            assert y.sharding == jax.sharding.NamedSharding(mesh, jax.P("data", "tensor"))
            np.testing.assert_array_equal(np.asarray(y), np.arange(32.0).reshape(8, 4))
    for array in (x, np.ones((8, 4))):  # under an abstract mesh: a raw TypeError / assert
        with jax.sharding.use_abstract_mesh(MESH.abstract_mesh):
            with pytest.raises(sk.ShardingError, match=r"(?s)outside jit.*Fix: call it inside"):
                sk.constrain(array, ("batch", "embed"), rules=rules)
