"""Each collective names the model path, the pass and the line of code that caused it."""

import inspect
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import shardkit as sk
from shardkit.report import build_report
from shardkit.report.provenance import Frame, frames_by_id, module_path_of, pass_of, source_of


@sk.axes({"up/kernel": ("embed", "mlp"), "down/kernel": ("mlp", "embed")})
class Good(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, use_bias=False, name="up")(x))
        return nn.Dense(16, use_bias=False, name="down")(h)


# A mis-annotated layer: its up-projection claims ("mlp", "embed"), so under tensor
# parallelism the contraction dimension is split and XLA must all-reduce its output.
@sk.axes({"up/kernel": ("mlp", "embed"), "down/kernel": ("mlp", "embed")})
class Bad(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, use_bias=False, name="up")(x))  # BAD LINE
        return nn.Dense(16, use_bias=False, name="down")(h)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Bad(name="bad")(Good(name="good")(x))


BAD_LINE = (
    next(i for i, line in enumerate(inspect.getsource(Bad).splitlines()) if "BAD LINE" in line)
    + inspect.getsourcelines(Bad)[1]
)


def init(rng):
    params = Net().init(rng, jnp.ones((1, 16)))["params"]
    return params, optax.sgd(0.1).init(sk.unbox(params))


def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(Net().apply({"params": p}, batch["x"]) ** 2)
    )(params)
    return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), opt_state), loss


def test_a_mis_annotated_layer_is_found_by_file_and_line():
    plan = sk.Plan(sk.Rules([("mlp", "tensor"), ("batch", None)]), sk.make_mesh({"tensor": 8}))
    abstract = plan.abstract_init(init, jax.random.key(0))
    report = build_report(plan, step, abstract, {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32)})
    at_bad = [c for c in report.collectives if c.source == f"test_provenance.py:{BAD_LINE}"]
    assert at_bad, [(c.kind, c.source, c.module_path) for c in report.collectives]
    forward = [c for c in at_bad if c.pass_ == "forward"]
    assert forward and forward[0].kind in ("all-reduce", "reduce-scatter")  # partial sums
    assert forward[0].module_path == "bad/up" and forward[0].where == "bad/up"
    # The well-annotated layer's forward needs no collective of its own.
    assert not [
        c for c in report.collectives if c.module_path == "good/up" and c.pass_ == "forward"
    ]
    row = report.to_json()["collectives"][report.collectives.index(forward[0])]
    assert (row["module_path"], row["pass"], row["source"]) == (
        "bad/up",
        "forward",
        f"test_provenance.py:{BAD_LINE}",
    )
    groups = report.collective_groups()
    assert sum(g.executions for g in groups) == sum(c.count for c in report.collectives)


@pytest.mark.parametrize(
    "op_name, path, kind",
    [
        ("jit(step)/jvp(GPT)/layers/mlp/up/dot_general", "layers/mlp/up", "forward"),
        (
            "jit(step)/transpose(jvp(GPT))/while/body/layers/attn/out/dot_general",
            "layers/attn/out",
            "backward",
        ),
        (
            "jit(step)/transpose(jvp())/while/body/closed_call/checkpoint/rematted_computation/"
            "bsd,dhk->bshk/dot_general",
            "",
            "remat",
        ),
        (  # jax 0.12 calls a scan body eval_jaxpr where 0.10 says closed_call
            "jit(traced)/transpose(jvp(GPT))/while/body/eval_jaxpr/layers/mlp/up/dot_general",
            "layers/mlp/up",
            "backward",
        ),
        ("jit(step)/(reduce_sum:transpose(jvp(GPT))/ln_f/reduce_sum)", "", "backward"),
        ("jit(step)/mul", "", "update"),
    ],
)
def test_op_names_give_the_model_path_and_pass(op_name, path, kind):
    assert module_path_of(op_name) == path and pass_of(op_name) == kind


def test_source_skips_libraries_and_plumbing():
    root = os.path.dirname(sk.__file__)
    stack = (
        Frame("/x/site-packages/flax/linen/linear.py", "Dense.__call__", 10),
        Frame(os.path.join(root, "annotate", "decorator.py"), "_pin", 3),
        Frame("/home/me/model.py", "Block.__call__", 42),
        Frame(os.path.join(root, "plan.py"), "traced", 7),
    )
    assert source_of(stack).where == "model.py:42"
    assert source_of(stack[:2]) is None


def test_frames_are_read_from_the_module_proto():
    # A hand-built HloModuleProto: field 17 (stack_frame_index) with one file, two
    # functions, two locations and a frame whose caller is frame 1.
    def varint(n):
        out = b""
        while n >= 0x80:
            out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
        return out + bytes([n])

    def field(number, payload):
        return varint(number << 3 | 2) + varint(len(payload)) + payload

    def ints(*pairs):
        return b"".join(varint(n << 3) + varint(v) for n, v in pairs)

    index = (
        field(1, b"m.py")
        + field(2, b"outer")
        + field(2, b"inner")
        + field(3, ints((1, 1), (2, 1), (3, 5)))
        + field(3, ints((1, 1), (2, 2), (3, 9)))
        + field(4, ints((1, 1)))
        + field(4, ints((1, 2), (2, 1)))
    )
    stacks = frames_by_id(field(17, index))
    assert [f.where for f in stacks[2]] == ["m.py:9", "m.py:5"]
    assert [f.function for f in stacks[2]] == ["inner", "outer"]
