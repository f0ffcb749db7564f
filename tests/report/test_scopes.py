"""Collectives are booked by shardkit's named scopes, never by the name of a source file."""

import importlib
import os
import textwrap

import jax
import jax.numpy as jnp
import pytest

import shardkit as sk
from shardkit.report import build_report
from shardkit.report.provenance import Frame, block_of, blocks_in, source_of

# A user's model: an MLP-style "attention" layer and a vocab-parallel loss of its own.
# Under tensor parallelism its down-projection's output is all-reduced and its logits'
# statistics are reduced over the vocabulary: activation collectives, whatever the
# files that hold the code are called.
ATTENTION = """
import flax.linen as nn
import shardkit as sk


@sk.axes({"up/kernel": ("embed", "mlp"), "down/kernel": ("mlp", "embed")})
class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, use_bias=False, name="up")(x))
        return nn.Dense(16, use_bias=False, name="down")(h)
"""
LOSS = """
import jax
import jax.numpy as jnp


def loss_fn(h, w, targets):
    logits = h @ w
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)
"""
MODEL = """
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import shardkit as sk


@sk.axes({"head": ("embed", "vocab")})
class Net(nn.Module):
    @nn.compact
    def __call__(self, x, targets):
        h = Attention(name="attention")(x)
        w = self.param("head", nn.initializers.normal(0.02), (16, 256))
        return loss_fn(h, w, targets)


def init(rng):
    x, t = jnp.ones((8, 16)), jnp.zeros((8,), jnp.int32)
    params = Net().init(rng, x, t)["params"]
    return params, optax.sgd(0.1).init(sk.unbox(params))


def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(
        lambda p: Net().apply({"params": p}, batch["x"], batch["t"])
    )(params)
    return (jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), opt_state), loss
"""


def _write(root, package, files):
    os.makedirs(root / package)
    (root / package / "__init__.py").write_text("")
    for name, text in files.items():
        (root / package / name).write_text(textwrap.dedent(text))
    return importlib.import_module(f"{package}.model")


def _terms(module):
    plan = sk.Plan(sk.Rules([("mlp", "tensor"), ("vocab", "tensor")]), sk.make_mesh({"tensor": 8}))
    abstract = plan.abstract_init(module.init, jax.random.key(0))
    batch = {
        "x": jax.ShapeDtypeStruct((8, 16), jnp.float32),
        "t": jax.ShapeDtypeStruct((8,), jnp.int32),
    }
    report = build_report(plan, module.step, abstract, batch)
    term = {id(c): t.term for t in report.wire_terms for c in t.collectives}
    booked = sorted(
        (c.kind, c.pass_, c.module_path, c.wire_bytes, term[id(c)]) for c in report.collectives
    )
    return report, booked


def test_a_users_attention_py_and_loss_py_get_the_terms_of_the_same_model_in_model_py(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(tmp_path))
    header = "from .attention import Attention\nfrom .loss import loss_fn\n"
    split = _write(
        tmp_path,
        "split_files",
        {"attention.py": ATTENTION, "loss.py": LOSS, "model.py": header + MODEL},
    )
    one = _write(tmp_path, "one_file", {"model.py": ATTENTION + LOSS + MODEL})
    split_report, split_terms = _terms(split)
    one_report, one_terms = _terms(one)
    assert split_terms == one_terms
    assert [(t.term, t.bytes) for t in split_report.wire_terms] == [
        (t.term, t.bytes) for t in one_report.wire_terms
    ]
    # Neither is context-parallel K/V or shardkit's loss: the model's own tensor-parallel
    # traffic, from the model's lines, made by no shardkit block.
    terms = {t for *_, t in split_terms}
    assert "activation collectives" in terms
    assert not terms & {"context-parallel K/V", "logits / loss collectives"}
    sources = {c.source.split(":")[0] for c in split_report.collectives if c.source}
    assert "attention.py" in sources and "loss.py" in sources
    assert all(c.block == "" for c in split_report.collectives)


def test_a_blocks_collectives_name_the_models_line_and_the_block():
    # gpt-tiny under cp: the ring's permutes are made by shardkit's attention block, at
    # the line of gpt.py that calls it; under fsdp no TSP frame names a weight gather.
    from shardkit import models

    cp = build_report(sk.Plan("cp"), model=models.get("gpt-tiny"), batch=8, seq=32)
    ring = [c for c in cp.collectives if c.kind == "collective-permute"]
    assert ring and {c.block.split(".")[0] for c in ring} == {"attention"}
    assert {c.source.split(":")[0] for c in ring} == {"gpt.py"}
    kv = {t.term: t for t in cp.wire_terms}["context-parallel K/V"]
    assert set(map(id, kv.collectives)) == set(map(id, ring))
    fsdp = build_report(sk.Plan("fsdp"), model=models.get("gpt-tiny"), batch=8, seq=32)
    # The weights' gathers: at the reference model's own lines (gpt.py; jax 0.12 books the
    # tied table's gather at the constraint in models/model.py that pins what Model.loss
    # reads). A gather of the targets (no logical axes) is not a weight's.
    gathers = [c for c in fsdp.collectives if c.kind == "all-gather" and c.logical]
    assert len(gathers) > 10
    assert {c.source.split(":")[0] for c in gathers} <= {"gpt.py", "model.py"}
    assert not any(c.block.startswith("tsp") for c in fsdp.collectives)


@pytest.mark.parametrize(
    "op_name, blocks, block",
    [
        ("jit(s)/jvp(GPT)/layers/mlp/up/dot_general", (), ""),
        (
            "jit(s)/jvp(GPT)/layers/attn/shardkit.attention/shardkit.attention.ring/ppermute",
            ("attention", "attention.ring"),
            "attention.ring",
        ),
        # the outermost scope under a transform is printed inside its parentheses
        (
            "jit(s)/transpose(jvp(shardkit.loss.chunked))/shardkit.loss/reduce_max",
            ("loss.chunked", "loss"),
            "loss",
        ),
        # the head's projection: the loss block called the model back
        (
            "jit(s)/jvp(GPT)/shardkit.loss.chunked/shardkit.model/wte/dot_general",
            ("loss.chunked", "model"),
            "",
        ),
        # ops XLA combined into one: the first's block (its stack frame is the first's)
        (
            "jit(s)/(reduce_sum:reduce_sum:jvp(shardkit.loss.chunked)/while/reduce_sum)",
            (),
            "",
        ),
        (
            "jit(s)/transpose(jvp(GPT))/(shardkit.model/scatter-add:shardkit.loss.head_view/r)",
            ("model",),
            "",
        ),
        # a user's scope that merely contains the word
        ("jit(s)/jvp(Net)/my.shardkit.attention/dot_general", (), ""),
    ],
)
def test_the_block_is_the_innermost_shardkit_scope(op_name, blocks, block):
    assert blocks_in(op_name) == blocks and block_of(op_name) == block


def test_source_skips_shardkits_blocks_by_their_path_in_the_package_not_their_name():
    root = os.path.dirname(sk.__file__)
    ours = Frame(os.path.join(root, "nn", "attention.py"), "_ring", 254)
    theirs = Frame("/home/me/attention.py", "Attention.__call__", 12)
    assert source_of((ours, theirs)).where == "attention.py:12"
    assert source_of((ours, theirs)).file == "/home/me/attention.py"
    tsp = Frame(os.path.join(root, "nn", "tsp.py"), "TspDot.__call__", 380)
    model = Frame(os.path.join(root, "models", "gpt.py"), "Mlp.__call__", 142)
    assert source_of((tsp, model)).where == "gpt.py:142"
