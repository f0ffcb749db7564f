import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardkit as sk
from shardkit import errors


@sk.axes({"kernel": ("embed", "mlp"), "bias": ("mlp",), "scale": ("embed",)})
class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.LayerNorm()(nn.Dense(4)(x) @ jnp.ones((4, 4)))


def params():
    return Net().init(jax.random.key(0), jnp.ones((1, 4)))["params"]


def expected_axes(p):
    return sk.logical_axes(p)


@pytest.mark.parametrize(
    "tx",
    [
        optax.adamw(1e-3),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
        optax.masked(
            optax.adam(1e-3),
            {
                "Dense_0": {"kernel": True, "bias": False},
                "LayerNorm_0": {"scale": True, "bias": False},
            },
        ),
    ],
    ids=["adamw", "chain_clip_adamw", "masked"],
)
def test_optimizer_state_mirrors_params(tx):
    boxed = params()
    plain = sk.unbox(boxed)
    state = {"params": boxed, "opt_state": tx.init(plain)}
    axes = sk.logical_axes(state)
    want = expected_axes(boxed)
    flat = jax.tree_util.tree_leaves_with_path(axes["opt_state"])
    mirrored = 0
    for path, ax in flat:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        if names[-1] == "kernel":
            assert ax == want["Dense_0"]["kernel"]
            mirrored += 1
        elif "count" in names:
            assert ax == ()
    assert mirrored >= 2 if "masked" not in str(tx) else mirrored >= 1


def test_boxes_need_not_survive_tree_map():
    boxed = params()
    plain = sk.unbox(boxed)
    mu = jax.tree.map(jnp.zeros_like, plain)  # no metadata at all
    axes = sk.logical_axes((boxed, {"mu": mu}))
    assert axes[1]["mu"]["Dense_0"]["kernel"] == ("embed", "mlp")
    assert axes[1]["mu"]["LayerNorm_0"]["bias"] == ("mlp",)


def test_nnx_optimizer_state_mirrors_params():
    @sk.axes({"kernel": ("embed", "mlp"), "bias": ("mlp",)})
    class Lin(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 8, rngs=rngs)

    with nnx.use_eager_sharding(False):
        model = Lin(nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    opt = optax.adamw(1e-3).init(sk.unbox(state))
    axes = sk.logical_axes((state, opt))
    assert axes[1][0].mu["dense"]["kernel"] == ("embed", "mlp")
    assert axes[1][0].count == ()


def test_path_axes_for_unannotated_trees():
    tree = {"enc": {"w": np.zeros((4, 8)), "b": np.zeros(8)}, "head": np.zeros((8, 2))}
    pa = sk.PathAxes([("enc/w$", ("embed", "mlp")), ("enc/b$", ("mlp",))])
    axes = pa(tree)
    assert axes["enc"]["w"] == ("embed", "mlp") and axes["head"] == (None, None)
    strict = sk.PathAxes(list(pa.entries and [("enc/w$", ("embed", "mlp"))]), on_unmatched="error")
    with pytest.raises(errors.UnmatchedPathError, match=r"(?s)2 leaf.*enc/b \(8,\).*head \(8, 2\)"):
        strict(tree)


def test_path_axes_ambiguous_and_rank_errors():
    tree = {"attn": {"kernel": np.zeros((4, 8))}}
    with pytest.raises(
        errors.AmbiguousAxesError, match=r"(?s)attn/kernel \(shape \(4, 8\)\).*'attn'.*'kernel'"
    ):
        sk.PathAxes([("attn", ("embed", "mlp")), ("kernel", ("mlp", "embed"))])(tree)
    # agreeing matches are fine
    assert sk.PathAxes([("attn", ("a", "b")), ("kernel", ("a", "b"))])(tree)["attn"]["kernel"] == (
        "a",
        "b",
    )
    with pytest.raises(errors.RankMismatchError, match=r"attn/kernel: shape \(4, 8\)"):
        sk.PathAxes([("kernel", ("embed", "mlp", "heads"))])(tree)
    # fewer names than dimensions: a prefix, as Flax reads them; the rest replicated
    (info,) = sk.annotate.describe_leaves(tree, annotations=sk.PathAxes([("kernel", ("e",))]))[0]
    assert (info.axes, info.prefix) == (("e", None), True)
    with pytest.raises(errors.RuleError):
        sk.PathAxes([("kernel", "embed")])
    with pytest.raises(errors.RuleError):
        sk.PathAxes([("(", ("embed",))])


def test_abstract_trees():
    abstract = jax.eval_shape(params)
    assert sk.logical_axes(abstract)["Dense_0"]["kernel"] == ("embed", "mlp")


def test_a_same_named_parameter_is_not_mistaken_for_optimizer_state():
    tree = {"dense": {"kernel": np.zeros((4, 8))}, "other": {"kernel": np.zeros((4, 8))}}
    pa = sk.PathAxes([("dense/kernel$", ("embed", "mlp"))], on_unmatched="error")
    with pytest.raises(errors.UnmatchedPathError, match="other/kernel"):
        pa(tree)


def test_keys_named_value_are_kept():
    tree = {"attn": {"value": {"kernel": np.zeros((4, 2))}}}
    pa = sk.PathAxes([("attn/value/kernel$", ("embed", "heads"))], on_unmatched="error")
    assert pa(tree)["attn"]["value"]["kernel"] == ("embed", "heads")


def test_unknown_unmatched_policy():
    with pytest.raises(errors.RuleError, match="on_unmatched"):
        sk.logical_axes({"w": np.zeros(2)}, on_unmatched="errors")


def test_an_unannotated_parameter_never_inherits_another_leafs_axes():
    # Regression: mirroring matched any shared path ending and shape, so h/0/mlp/bias
    # (deeper than ln_f/bias) silently took ('embed',) and no error was raised.
    tree = {"ln_f": {"bias": np.zeros(8)}, "h": {"0": {"mlp": {"bias": np.zeros(8)}}}}
    pa = sk.PathAxes([("ln_f/bias$", ("embed",))], on_unmatched="error")
    with pytest.raises(errors.UnmatchedPathError, match=r"(?s)1 leaf.*h/0/mlp/bias \(8,\)"):
        pa(tree)
    lenient = sk.PathAxes([("ln_f/bias$", ("embed",))])(tree)
    assert lenient["h"]["0"]["mlp"]["bias"] == (None,)


def test_optimizer_state_is_recognised_however_patterns_are_written():
    # A pattern for the parameter also matches its moments' paths; they are still
    # optimizer state, and mirror the parameter (a moment of an unmatched parameter
    # is not listed as unmatched a second time).
    params = {"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}}
    state = (params, optax.adamw(1e-3).init(params))
    pa = sk.PathAxes([("dense/kernel$", ("embed", "mlp"))], on_unmatched="error")
    with pytest.raises(errors.UnmatchedPathError, match=r"(?s)^1 leaf.*0/dense/bias \(8,\)\n"):
        sk.logical_axes(state, annotations=pa)
    infos, _ = sk.annotate.describe_leaves(state, annotations=pa)
    by_path = {i.path: i for i in infos}
    mu = by_path["1/0/mu/dense/kernel"]
    assert (mu.kind, mu.source, mu.axes) == ("optimizer", "mirror", ("embed", "mlp"))
    assert by_path["0/dense/kernel"].kind == "param"
    assert by_path["1/0/count"].kind == "scalar"


def test_logical_axes_honours_the_path_axes_policy():
    # Regression: sk.logical_axes(tree, annotations=pa) ignored pa.on_unmatched.
    tree = {"w": np.zeros((4, 8)), "b": np.zeros(8)}
    pa = sk.PathAxes([("w$", ("embed", "mlp"))], on_unmatched="error")
    with pytest.raises(errors.UnmatchedPathError, match=r"b \(8,\)"):
        sk.logical_axes(tree, annotations=pa)
    with pytest.raises(errors.UnmatchedPathError):
        pa(tree)
    assert sk.logical_axes(tree, annotations=pa, on_unmatched="replicate")["b"] == (None,)


def test_parameters_named_like_optimizer_fields_are_parameters():
    # A VAE's 'mu' layer or a 'trace' module is a parameter, annotated like any other.
    tree = {
        "enc": {"kernel": np.zeros((4, 8))},
        "mu": {"kernel": np.zeros((8, 4))},
        "trace": {"w": np.zeros(4)},
    }
    pa = sk.PathAxes(
        [
            ("enc/kernel$", ("embed", "mlp")),
            ("mu/kernel$", ("mlp", "embed")),
            ("trace/w$", ("embed",)),
        ],
        on_unmatched="error",
    )
    infos = {i.path: i for i in sk.annotate.describe_leaves(tree, annotations=pa)[0]}
    assert infos["mu/kernel"].axes == ("mlp", "embed") and infos["mu/kernel"].kind == "param"
    assert infos["trace/w"].kind == "param"


def test_a_hand_made_optimizer_state_mirrors_its_parameters():
    # Not optax: a NamedTuple of moments. Anchored patterns name the parameters only; the
    # moments are deeper copies of them, so they mirror and count as optimizer state.
    from typing import NamedTuple

    class Moments(NamedTuple):
        m: dict
        v: dict

    params = {"dense": {"kernel": np.zeros((4, 8))}}
    state = (params, Moments(params, params))
    pa = sk.PathAxes([("^0/dense/kernel$", ("embed", "mlp"))], on_unmatched="error")
    infos = {i.path: i for i in sk.annotate.describe_leaves(state, annotations=pa)[0]}
    for moment in ("m", "v"):
        info = infos[f"1/{moment}/dense/kernel"]
        assert (info.axes, info.kind, info.source) == (("embed", "mlp"), "optimizer", "mirror")


def test_a_copy_of_parameters_that_disagree_is_ambiguous():
    # opt_state/mu/w could be a/w's or b/w's moment: same name, same shape, other axes.
    tree = {
        "params": {"a": {"w": np.zeros(8)}, "b": {"w": np.zeros(8)}},
        "opt_state": {"mu": {"w": np.zeros(8)}},
    }
    pa = sk.PathAxes([("a/w$", ("embed",)), ("b/w$", ("mlp",))])
    with pytest.raises(errors.AmbiguousAxesError, match=r"(?s)opt_state/mu/w.*params/a/w.*b/w"):
        sk.logical_axes(tree, annotations=pa)


def test_flax_names_fewer_than_dimensions_are_a_prefix_a_pattern_completes():
    tree = {
        "attn": {"kernel": nn.LogicallyPartitioned(np.zeros((8, 2, 4)), ("embed", "kv"))},
        "mlp": {"kernel": nn.LogicallyPartitioned(np.zeros((8, 4)), ("embed", "mlp"))},
    }
    infos = {i.path: i for i in sk.annotate.describe_leaves(tree)[0]}
    assert (infos["attn/kernel"].axes, infos["attn/kernel"].prefix) == (("embed", "kv", None), True)
    assert (infos["mlp/kernel"].axes, infos["mlp/kernel"].prefix) == (("embed", "mlp"), False)
    # A pattern replaces a prefix Flax stored; names Flax stored in full win over it.
    pa = sk.PathAxes([("kernel$", ("embed", "heads", "kv")), ("mlp/kernel$", ("mlp", "embed"))])
    infos = {i.path: i for i in sk.annotate.describe_leaves(tree, annotations=pa)[0]}
    assert (infos["attn/kernel"].axes, infos["attn/kernel"].source) == (
        ("embed", "heads", "kv"),
        "annotation",
    )
    assert not infos["attn/kernel"].prefix
    assert (infos["mlp/kernel"].axes, infos["mlp/kernel"].source) == (("embed", "mlp"), "flax")
    # ... and a pattern naming fewer dimensions than the stored prefix does not.
    short = sk.PathAxes([("kernel$", ("mlp",))])
    (attn, _) = sk.annotate.describe_leaves(tree, annotations=short)[0]
    assert (attn.axes, attn.source) == (("embed", "kv", None), "flax")
    # A moment (a deeper copy of the parameter) mirrors the padded axes and the flag.
    moments = sk.annotate.describe_leaves((tree, {"mu": sk.unbox(tree)}))[0]
    mu = next(i for i in moments if i.path == "1/mu/attn/kernel")
    assert (mu.axes, mu.prefix, mu.kind) == (("embed", "kv", None), True, "optimizer")
    with pytest.raises(errors.RankMismatchError, match=r"attn/kernel: shape \(8,\) has 1"):
        sk.logical_axes({"attn": {"kernel": nn.LogicallyPartitioned(np.zeros(8), ("a", "b"))}})
