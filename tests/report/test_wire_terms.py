import json
import math
import re

import jax
import pytest

import shardkit as sk
from shardkit import models, recipes
from shardkit.errors import ShardingError
from shardkit.report import build_report, wire_terms
from shardkit.report.analytic import analytic_model
from shardkit.report.hlo import LOWERED_RS, Collective
from shardkit.report.records import ParamRow
from shardkit.report.render import to_text
from shardkit.report.wire_terms import ParamMatch, attribute, explain, term_of

# ---------------------------------------------------------------- hand-built collectives

UP = ParamRow(
    "params/layers/mlp/up/kernel",
    (2, 64, 256),
    "float32",
    ("layers", "embed", "mlp"),
    "P(None, 'fsdp')",
    0,
    False,
    "param",
    shard_shape=(2, 8, 256),
    mesh_axes=((), ("fsdp",), ()),
)
WTE = ParamRow(
    "params/wte/embedding",
    (512, 64),
    "float32",
    ("vocab", "embed"),
    "P('fsdp')",
    0,
    False,
    "param",
    shard_shape=(64, 64),
    mesh_axes=(("fsdp",), ()),
)
ROWS = [UP, WTE]


def coll(
    kind,
    shapes,
    *,
    count=2,
    pass_="forward",
    path="layers/mlp/up",
    source="gpt.py:1",
    block="",
    wire=100.0,
    lowered="",
    group=8,
):
    return Collective(
        kind=kind,
        bytes=0,
        group_size=group,
        wire_bytes=wire,
        count=count,
        dtype="f32",
        shapes=shapes,
        module_path=path,
        pass_=pass_,
        source=source,
        block=block,
        lowered_as=lowered,
    )


def test_param_match_knows_a_weight_by_its_layer_slice_whole_sharded_or_transposed():
    params = ParamMatch.of(ROWS)
    assert params.rows((64, 256)) == (UP,)  # one layer, gathered
    assert params.rows((1, 64, 256)) == (UP,)  # 1s do not count
    assert params.rows((256, 64)) == (UP,)  # transposed
    assert params.rows((8, 256)) == (UP,)  # the stored shard of one layer
    assert params.rows((512, 64)) == (WTE,)
    assert params.rows((8, 512, 64)) == ()  # an activation


@pytest.mark.parametrize(
    "c, term",
    [
        (coll("all-gather", [(64, 256)]), "weight all-gathers"),
        (coll("reduce-scatter", [(64, 256), (7, 7)], pass_="backward"), "gradient reductions"),
        (coll("all-reduce", [(64, 256)], pass_="forward"), "activation collectives"),
        (coll("all-gather", [(8, 32, 64)], block="loss.chunked"), "logits / loss collectives"),
        (
            coll("collective-permute", [(2, 8, 64)], block="attention.ring"),
            "context-parallel K/V",
        ),
        # a model's own files named attention.py and loss.py are the model's code
        (
            coll("collective-permute", [(2, 8, 64)], source="attention.py:9"),
            "activation collectives",
        ),
        (coll("all-gather", [(8, 32, 64)], source="loss.py:147"), "activation collectives"),
        # the head's projection, called back by the loss block, is the model's
        (coll("all-gather", [(8, 32, 64)], block=""), "activation collectives"),
        (coll("all-gather", [(8, 32, 64)], block="tsp.head"), "activation collectives"),
        (coll("all-reduce", [(), ()], pass_="update", path=""), "other collectives"),
        (coll("all-reduce", [(8, 32, 64)]), "activation collectives"),
    ],
)
def test_term_of_each_rule(c, term):
    assert term_of(c, ParamMatch.of(ROWS)) == term


def test_pipeline_permutes_are_their_own_term():
    c = coll("collective-permute", [(4, 32, 64)], block="pipeline.send")
    assert term_of(c, ParamMatch.of(ROWS), stages=2) == "pipeline transfers"
    assert term_of(c, ParamMatch.of(ROWS), stages=1) == "activation collectives"


def test_attribute_adds_up_and_takes_the_analytic_values():
    cs = [
        coll("all-gather", [(64, 256)], wire=30.0),
        coll("reduce-scatter", [(64, 256)], pass_="backward", wire=20.0),
        coll("all-reduce", [(8, 32, 64)], wire=5.0),
    ]
    terms = attribute(
        cs,
        ROWS,
        analytic={
            "weight all-gathers": 60.0,
            "gradient reductions": 20.0,
            "context-parallel K/V": 1.0,
        },
    )
    by = {t.term: t for t in terms}
    assert sum(t.bytes for t in terms) == 55.0
    assert by["weight all-gathers"].ratio == 0.5 and by["gradient reductions"].ratio == 1.0
    assert by["context-parallel K/V"].bytes == 0.0  # analytic only: listed, measured 0
    assert by["activation collectives"].analytic_bytes is None


def test_explanations_count_gathers_and_name_what_is_never_gathered():
    # up's layer slice gathered forward and in the remat, for each of 2 layers; the
    # embedding never: the analytic value (2 gathers of each) is twice what moves.
    cs = [
        coll("all-gather", [(64, 256)], pass_="forward", wire=10.0),
        coll("all-gather", [(256, 64)], pass_="remat", wire=10.0),
        coll(
            "reduce-scatter",
            [(64, 256), (512, 64)],
            pass_="backward",
            wire=40.0,
            lowered=LOWERED_RS,
            count=1,
            path="layers",
        ),
    ]
    terms = attribute(cs, ROWS, analytic={"weight all-gathers": 40.0, "gradient reductions": 40.0})
    [e] = explain(terms, ROWS)  # the reductions are on the analytic value: not explained
    assert (e.term, e.ratio) == ("weight all-gathers", 0.5)
    assert "layers/mlp/up/kernel gathered 2× per step (1 forward all-gather + 1 remat " in e.why
    assert "wte/embedding (512, 64) is never gathered: the rule ('vocab', 'fsdp')" in e.why
    assert "vocab-parallel" in e.why and "−50% of the analytic term" in e.why
    # the analytic value in gathers of every sharded weight: one gather of both moves
    # (2·64·256 + 512·64) values · 4 B · 7/8 (each split over 8)
    once = (2 * 64 * 256 + 512 * 64) * 4 * (1 - 1 / 8)
    assert f"is {40.0 / once:.3g} gathers of every sharded weight" in e.why


def test_explanations_name_a_lowered_reduce_scatter_and_an_all_reduced_gradient():
    cs = [
        coll("reduce-scatter", [(64, 256)], pass_="backward", lowered=LOWERED_RS, wire=10.0),
        coll("all-reduce", [(512, 64)], pass_="backward", path="", count=1, wire=30.0),
    ]
    [e] = explain(attribute(cs, ROWS, analytic={"gradient reductions": 20.0}), ROWS)
    assert "wte/embedding reduced 1× per step (1 backward all-reduce)" in e.why
    assert "1 of 2 gradients (50.0% of the parameters) are all-reduced" in e.why
    assert f"1 of 2 ops are reduce-scatters the CPU program runs as {LOWERED_RS}" in e.why


def test_explanations_of_other_terms_group_by_source_with_runs():
    ring = coll(
        "collective-permute",
        [(2, 8, 64)],
        source="gpt.py:105",
        block="attention.ring",
        count=14,
        pass_="forward",
        wire=100.0,
        path="layers/attn",
    )
    zigzag = coll(
        "collective-permute",
        [(3, 8, 32)],
        source="gpt.py:105",
        block="attention.zigzag",
        count=2,
        pass_="remat",
        wire=40.0,
        path="layers/attn",
    )
    [e] = explain(attribute([ring, zigzag], ROWS, analytic={"context-parallel K/V": 100.0}), ROWS)
    assert e.ratio == 1.4
    assert e.why.startswith(
        "140 B measured vs 100 B analytic: the analytic formula's traffic "
        "is 14 runs of collective-permute (14 forward; 7 per layer"
    )
    assert (
        "beyond it: 2 runs of collective-permute (2 remat, largest f32[3,8,32] over 8) "
        "from gpt.py:105 (attention.zigzag) in layers/attn: 40 B" in e.why
    )


# ---------------------------------------------------------------- analytic terms


@pytest.mark.parametrize("recipe", recipes.names())
def test_analytic_terms_split_the_analytic_wire_bytes(recipe):
    cfg = models.CONFIGS["gpt-small"]
    m = analytic_model(
        cfg.dims(),
        recipe,
        recipes.get(recipe).axis_sizes(8),
        batch=8,
        seq=512,
        remat="full",
        pipeline={"microbatches": 4, "schedule": "1f1b"},
    )
    assert m.wire_terms
    assert sum(m.wire_terms.values()) == pytest.approx(sum(m.wire_bytes_by_kind.values()))
    assert set(m.wire_terms) <= set(wire_terms.TERMS)


def test_analytic_fsdp_terms_are_zero3s_formulas():
    cfg = models.CONFIGS["gpt-small"]
    psi = cfg.param_count()
    fsdp = recipes.get("fsdp").with_logits("tokens")  # the head gathers its weight
    m = analytic_model(cfg.dims(), fsdp, {"fsdp": 8}, batch=8, seq=512, remat="full")
    # Rajbhandari et al.: all-gathers of 2Ψ forward + backward, a reduce-scatter of Ψ
    assert m.wire_terms == pytest.approx(
        {"weight all-gathers": 2 * psi * 4 * 7 / 8, "gradient reductions": psi * 4 * 7 / 8}
    )


# ---------------------------------------------------------------- compiled steps

#: A count (runs, gathers per step, live buffers, heap offsets), a source line, an
#: array's shape, an HLO instruction, or a lowered form.
EVIDENCE = re.compile(
    r"\d+(\.\d+)?× per step|\b\d+ runs? of|\b\d+ buffers? live|offset [\d,]+|\w+\.py:\d+"
    r"|\b[a-z]\w*\[[\d,]*\]|\b[a-z][\w\-]*\.\d+\b|" + re.escape(LOWERED_RS)
)


def names_evidence(why: str, report) -> bool:
    """Whether ``why`` names evidence: :data:`EVIDENCE`, or a path of the model (a
    parameter's, or an op's)."""
    paths = {r.path.removeprefix("params/") for r in report.params if r.kind == "param"}
    paths |= {c.where for c in report.collectives if c.where}
    return bool(EVIDENCE.search(why)) or any(p in why for p in paths)


_CACHE: dict = {}


def _report(name, recipe, seq, itemise=False):
    """The compile-only report, once per module (the tests below share them)."""
    key = (name, recipe, seq)
    if key in _CACHE and (_CACHE[key].memory_terms or not itemise):
        return _CACHE[key]
    _CACHE[key] = _build(name, recipe, seq, itemise)
    return _CACHE[key]


def _build(name, recipe, seq, itemise):
    model = models.get(name, remat="full")
    for n in (8, 4):  # 8 devices, or 4 where 8 does not divide the model
        try:
            plan = sk.Plan(recipe, devices=jax.devices()[:n])
            return build_report(plan, model=model, batch=8, seq=seq, itemise=itemise)
        except ShardingError as e:
            error = e
    raise error


#: One recipe per family on the two reference models, compile only (every recipe:
#: benchmarks/memory_terms.py; pipelines, 35 s a compile here, only there): FSDP,
#: context parallel, TP + SP with the memory terms too, ZeRO-1, TSP (its rules-only form).
CASES = [
    ("gpt-small", "fsdp", False),
    ("gpt-small", "cp", False),
    ("llama-small", "tp_sp", True),
    ("llama-small", "zero1", False),
    ("gpt-small", "tsp_gspmd", False),
]


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{r}" for n, r, _ in CASES])
def report(request):
    name, recipe, itemise = request.param
    return _report(name, recipe, 512, itemise)


def test_every_gap_over_ten_percent_is_explained_with_evidence(report):
    explained = {e.term: e for e in report.explanations}
    terms = [*report.wire_terms, *report.memory_terms]
    assert report.wire_terms
    for t in terms:
        if t.bytes and (t.ratio is None or abs(t.ratio - 1) > 0.10):
            assert t.term in explained, f"{report.recipe}: {t.term} unexplained"
            why = explained[t.term].why
            assert names_evidence(why, report), f"{report.recipe}: {t.term}: {why}"
    assert sum(t.bytes for t in report.wire_terms) == pytest.approx(report.wire_bytes)


def test_the_check_fails_when_an_explanation_loses_its_evidence(report, monkeypatch):
    # The same terms explained with the evidence taken out (a canned sentence instead of
    # the per-parameter counts and the groups by source line) fail the check.
    monkeypatch.setattr(wire_terms, "_per_param", lambda *a, **k: "layout effects")
    monkeypatch.setattr(wire_terms, "_by_source", lambda *a, **k: "not modelled")
    off = explain(report.wire_terms, report.params)
    assert off and not any(names_evidence(e.why, report) for e in off)


def test_the_json_carries_terms_explanations_and_layouts(report):
    d = json.loads(json.dumps(report.to_json()))
    assert {t["term"] for t in d["wire_terms"]} == {t.term for t in report.wire_terms}
    for e in d["explanations"]:
        assert set(e) == {"term", "measured_bytes", "analytic_bytes", "ratio", "why"}
    for c in d["collectives"]:
        assert c["term"] in wire_terms.TERMS and isinstance(c["shape"], list)
    text = to_text(report, width=80)
    assert "wire bytes by term" in text and all(len(line) <= 80 for line in text.splitlines())


def test_gpt_small_fsdp_moves_its_weights_but_the_vocab_parallel_embedding():
    r = _report("gpt-small", "fsdp", 512)
    cfg = models.CONFIGS["gpt-small"]
    by = {t.term: t for t in r.wire_terms}
    # Hand count: every sharded weight but the tied embedding (V·h, vocab-parallel) is
    # gathered forward and again for the backward pass over 8 devices, 2·Ψ'·4·7/8. The
    # position table is read as its first 512 rows (an activation-shaped slice).
    tables = {"params/wte/embedding", "params/wpe/embedding"}
    rest = sum(
        math.prod(p.shape)
        for p in r.params
        if p.kind == "param" and p.shard_shape != p.shape and p.path not in tables
    )
    assert rest < cfg.param_count() - cfg.vocab * cfg.d_model
    assert by["weight all-gathers"].bytes == pytest.approx(2 * rest * 4 * 7 / 8, rel=1e-3)
    why = {e.term: e.why for e in r.explanations}["weight all-gathers"]
    assert "wte/embedding (50304, 768) is never gathered: the rule ('vocab', 'fsdp')" in why
    assert "layers/mlp/up/kernel" in why and "2× per step" in why
    gathers = [
        c for c in r.collectives if c.kind == "all-gather" and c.module_path == "layers/mlp/up"
    ]
    assert gathers and all(
        c.logical == ("layers", "embed", "mlp") and c.rule == "('embed', 'fsdp')" for c in gathers
    )


def test_cp_moves_the_ring_alone_its_tokens_placed_in_zigzag_order():
    r = _report("gpt-small", "cp", 512)
    cfg = models.CONFIGS["gpt-small"]
    kv = {t.term: t for t in r.wire_terms}["context-parallel K/V"]
    # Hand count of the ring: K and V blocks [2, b, s/8, h] f32 cross 7 hops per layer,
    # forward, recomputed and backward. The batch is placed in the zigzag order
    # (shardkit.balance): no layer reorders anything, and its rows (one document each,
    # batch["zigzag"]) have static masks, so no segment ids or positions travel.
    blocks = 7 * 2 * 8 * (512 // 8)
    ring = cfg.n_layers * 3 * blocks * cfg.d_model * 4
    assert kv.analytic_bytes == pytest.approx(ring)
    assert kv.bytes == pytest.approx(ring, rel=1e-3)
    assert not any(c.block == "attention.zigzag" for c in r.collectives)
