import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import shardkit as sk
from shardkit.cli import main
from shardkit.models import get
from shardkit.report import build_report

TX = optax.sgd(0.1)


@pytest.fixture(scope="module")
def fsdp_report():
    return build_report(sk.Plan("fsdp"), model=get("gpt-tiny"), batch=8, seq=32)


def test_report_numbers_are_consistent(fsdp_report):
    r = fsdp_report
    m = r.memory
    assert m.total == m.arguments + m.output + m.temp - m.alias
    assert r.flops and r.flops > 0
    params = [p for p in r.params if p.kind == "param"]
    optimizer = [p for p in r.params if p.kind == "optimizer"]
    assert len(optimizer) >= 2 * len(params)  # Adam's mu and nu mirror every parameter
    embed = next(p for p in params if p.path == "params/wte/embedding")
    assert embed.logical == ("vocab", "embed") and embed.spec == "P('fsdp', None)"
    assert embed.bytes_per_device == 256 * 64 * 4 // 8
    assert r.replicated_fraction < 0.05
    assert r.ratios()["state_memory"] == pytest.approx(1.0, abs=0.1)
    assert sum(c.wire_bytes for c in r.collectives) == pytest.approx(r.wire_bytes)


def test_a_report_renders_itself(fsdp_report):
    from rich.console import Console

    assert sk.report.Report is type(fsdp_report)
    console = Console(record=True, width=100)
    console.print(fsdp_report)  # rich's protocol
    text = console.export_text()
    for part in (
        "fsdp on fsdp=8",
        "gpt-tiny, batch 8, seq 32",
        "memory per device",
        "wire bytes per device per step",
        "largest collectives",
    ):
        assert part in text and part in str(fsdp_report)
    assert fsdp_report.to_json()["workload"]["model"] == "gpt-tiny"


def test_report_json_schema(fsdp_report):
    d = json.loads(json.dumps(fsdp_report.to_json()))
    assert set(d["memory_per_device_bytes"]) == {"arguments", "output", "temp", "alias", "total"}
    assert set(d["analytic_memory_per_device_bytes"]) == {
        "params",
        "grads",
        "optimizer",
        "activations",
        "total",
        "phases",
        "peak_phase",
    }
    assert {"kind", "bytes", "wire_bytes", "group_size", "op_name"} <= set(d["collectives"][0])
    assert {"path", "shape", "logical", "spec", "bytes_per_device"} <= set(d["params"][0])
    for key in (
        "wire_bytes_by_kind",
        "analytic_wire_bytes_by_kind",
        "replicated_fraction",
        "warnings",
        "flops",
    ):
        assert key in d


def _mlp(down_axes):
    @sk.axes({"up/kernel": ("embed", "mlp"), "down/kernel": down_axes})
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(64, use_bias=False, name="up")(x))
            h = sk.constrain(h, ("batch", "mlp"))
            return nn.Dense(16, use_bias=False, name="down")(h)

    return Mlp()


def _lint(model):
    def init(rng):
        params = model.init(rng, jnp.ones((1, 16)))["params"]
        return params, TX.init(sk.unbox(params))

    def step(state, batch):
        params, opt = state
        grads = jax.grad(lambda p: jnp.mean(model.apply({"params": p}, batch["x"]) ** 2))(params)
        updates, opt = TX.update(grads, opt, params)
        return (optax.apply_updates(params, updates), opt), None

    plan = sk.Plan("tp")
    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32)}
    compiled = plan.compile(step, plan.abstract_init(init, jax.random.key(0)), batch)
    return build_report(plan, compiled, jax.eval_shape(init, jax.random.key(0)))


def test_lint_names_the_op_a_broken_annotation_makes_xla_gather():
    good = _lint(_mlp(("mlp", "embed")))  # row-parallel, as Megatron
    assert not [w for w in good.warnings if w.startswith("unexpected")]
    broken = _lint(_mlp(("embed", "mlp")))  # the down kernel annotated like the up kernel
    [warning] = [w for w in broken.warnings if w.startswith("unexpected all-gather")]
    assert "down/dot_general" in warning and "Likely cause" in warning
    # what it gathers is the [batch, mlp] activation, not a weight: the report's wire term
    assert "f32[8,64]" in warning and "(wire term: activation collectives)" in warning


def test_lint_flags_rules_that_match_nothing(fsdp_report):
    plan = sk.Plan(sk.Rules([("vocab", "data"), ("embd", "data")]), sk.make_mesh({"data": 8}))
    r = build_report(plan, model=get("gpt-tiny"), batch=8, seq=32)
    assert any("('embd', 'data') matched no parameter" in w for w in r.warnings)


def test_cli_report_json_and_compare_plot(tmp_path, capsys):
    assert main(["report", "--model", "gpt-tiny", "--recipe", "dp", "--seq", "32", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["recipe"] == "dp" and d["mesh"] == {"data": 8} and d["devices"] == 8
    assert set(d["wire_bytes_by_kind"]) == {"all-reduce"}
    png = tmp_path / "compare.png"
    args = ["compare", "--model", "gpt-tiny", "--seq", "32", "--recipes", "dp,fsdp"]
    assert main([*args, "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "dp" in out and "fsdp" in out


def test_builtin_recipes_do_not_flag_axes_the_model_lacks():
    # tp carries a kv_heads rule for Llama; GPT has no kv_heads axis.
    r = build_report(sk.Plan("tp"), model=get("gpt-tiny"), batch=8, seq=32)
    assert not [w for w in r.warnings if "matched no parameter" in w]


def _tied_report(replicas: bool):
    """DP report of a tiny tied-embedding model, read through per_replica or not."""
    vocab, width, table_axes = 512, 64, ("vocab", "embed")

    def loss(params, tokens):
        table = params["table"]
        view = sk.per_replica(table, table_axes, data=tokens)
        if not replicas:
            view = sk.ReplicaView(table)
        x = jnp.tanh(view.map(lambda t, ids: jnp.take(t, ids, axis=0), tokens))
        logits = view.map(lambda t, y: jnp.einsum("bsd,vd->bsv", y, t), x)
        return jax.nn.logsumexp(logits, -1).mean()

    def init(rng):
        table = jax.random.normal(rng, (vocab, width))
        return {"table": nn.Partitioned(table, names=table_axes)}

    def step(params, batch):
        grads = jax.grad(loss)(params, batch["tokens"])
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), None

    plan = sk.Plan("dp")
    batch = {"tokens": jax.ShapeDtypeStruct((8, 16), jnp.int32)}
    compiled = plan.compile(step, sk.unbox(plan.abstract_init(init, jax.random.key(0))), batch)
    state = jax.eval_shape(init, jax.random.key(0))
    return build_report(plan, compiled, state, replicated_threshold_bytes=0)


def test_lint_flags_a_weight_whose_gradient_is_all_reduced_twice():
    [warning] = [w for w in _tied_report(replicas=False).warnings if "all-reduced" in w]
    assert warning.startswith("table (512, 64)") and "all-reduced 2 times" in warning
    assert "sk.per_replica" in warning
    assert not [w for w in _tied_report(replicas=True).warnings if "all-reduced" in w]


def _all_reduce(shapes, group, count=1):
    from shardkit.report.hlo import Collective

    return Collective(
        kind="all-reduce",
        bytes=0,
        group_size=group,
        wire_bytes=0.0,
        count=count,
        op_name="op",
        dtype="f32",
        shapes=shapes,
    )


@pytest.mark.parametrize(
    "collectives, flagged",
    [
        ([_all_reduce([(512, 64)], 8)], False),  # one all-reduce over all copies
        ([_all_reduce([(512, 64), (64,)], 2), _all_reduce([(512, 64)], 4)], False),  # per axis
        ([_all_reduce([(512, 64)], 8, count=12)], False),  # inside a loop: another weight's
        ([_all_reduce([(512, 64), (512, 64)], 8)], True),  # two reads, one tuple
    ],
    ids=["once", "once-per-axis", "in-a-loop", "twice"],
)
def test_reduced_more_than_once_counts_reductions_per_copy(collectives, flagged):
    from shardkit.report.lint import reduced_more_than_once
    from shardkit.report.records import ParamRow

    row = ParamRow(
        "table",
        (512, 64),
        "float32",
        ("vocab", "embed"),
        "P()",
        512 * 64 * 4,
        True,
        "param",
        shard_shape=(512, 64),
    )
    warnings = reduced_more_than_once(collectives, [row], devices=8, min_bytes=0)
    assert bool(warnings) == flagged


def test_a_total_off_its_analytic_phase_peak_is_explained():
    from shardkit.report.analytic import AnalyticMemory, AnalyticModel
    from shardkit.report.memory import MemoryStats
    from shardkit.report.report import _explain_memory

    phases = {"layers": 100.0, "head_loss": 80.0, "optimizer_step": 60.0}
    analytic = AnalyticModel(AnalyticMemory(10, 10, 20, 30, phases=phases), {}, ())
    over = _explain_memory(MemoryStats(arguments=116, output=0, temp=0, alias=0), analytic)
    assert [(e.term, e.ratio) for e in over] == [("memory total", 1.16)]
    assert "layers phase" in over[0].why and "recomputed" in over[0].why
    assert _explain_memory(MemoryStats(109, 0, 0, 0), analytic) == []  # within 10 %
    under = _explain_memory(MemoryStats(80, 0, 0, 0), analytic)
    assert under[0].ratio == 0.8 and "reuses buffers" in under[0].why
    no_phases = AnalyticModel(AnalyticMemory(10, 10, 20, 30), {}, ())
    assert _explain_memory(MemoryStats(500, 0, 0, 0), no_phases) == []


def test_explanations_are_in_the_json(fsdp_report):
    d = fsdp_report.to_json()
    ratio = fsdp_report.memory.total / fsdp_report.analytic.memory.total
    total = [e for e in d["explanations"] if e["term"] == "memory total"]
    assert len(total) == (abs(ratio - 1) > 0.10)
    # and one per wire term off by more than 10 % (shardkit.report.wire_terms)
    off = {t["term"] for t in d["wire_terms"] if t["ratio"] is None or abs(t["ratio"] - 1) > 0.1}
    assert {e["term"] for e in d["explanations"]} - {"memory total"} == off
