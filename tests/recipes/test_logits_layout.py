"""fsdp's logits layout: split over the vocabulary while a step has fewer tokens than it."""

import re

import jax
import pytest

import shardkit as sk
from shardkit import models, recipes
from shardkit.recipes import VocabRules
from shardkit.report import build_report

LOGITS = ("batch", "length", "vocab")
FSDP = recipes.get("fsdp")


@pytest.mark.parametrize(
    "devices, tokens, vocab, split",
    [
        (8, 8 * 512, 50304, "vocab"),  # GPT-2-small, 8 x 512: 4,096 tokens < 50,304
        (64, 64 * 2048, 50688, "tokens"),  # 7B on 64 devices: 131,072 > 50,688
        (8, 256, 256, "vocab"),  # equal: the same bytes either way, the rules as written
        (8, 257, 256, "tokens"),
    ],
)
def test_auto_compares_the_gathered_tokens_with_the_vocabulary(devices, tokens, vocab, split):
    spec = FSDP.step_activation_rules({"fsdp": devices}, tokens=tokens, vocab=vocab).spec(LOGITS)
    want = {"vocab": (None, None, "fsdp"), "tokens": ("fsdp", None, None)}[split]
    assert tuple(spec) == want
    assert FSDP.gathered_tokens({"fsdp": devices}, tokens) == tokens  # pure fsdp: all of them


def test_layouts_by_hand_and_recipes_without_the_choice():
    mesh = {"fsdp": 64}
    big = dict(tokens=64 * 2048, vocab=50688)
    assert FSDP.with_logits("vocab").step_activation_rules(mesh, **big) == FSDP.activation_rules
    assert tuple(
        FSDP.with_logits("tokens").step_activation_rules(mesh, tokens=8, vocab=10**6).spec(LOGITS)
    ) == ("fsdp", None, None)
    assert FSDP.step_activation_rules(mesh) == FSDP.activation_rules  # tokens unknown
    # tp splits the vocabulary over an axis that does not split the tokens: nothing to choose.
    tp = recipes.get("tp")
    assert tp.vocab_gather_axes({"tensor": 4}) == ()
    assert tp.step_activation_rules({"tensor": 4}, **big) == tp.activation_rules
    with pytest.raises(sk.ShardingError, match="logits is one of"):
        FSDP.with_logits("rows")


def test_vocab_rules_decide_per_array():
    # What plan.jit enters: it knows the batch's tokens, and each array its vocabulary.
    rules = FSDP.step_activation_rules({"fsdp": 8}, tokens=1024)
    assert isinstance(rules, VocabRules)
    assert tuple(rules.spec(LOGITS, shape=(8, 128, 50304))) == (None, None, "fsdp")
    assert tuple(rules.spec(LOGITS, shape=(8, 128, 256))) == ("fsdp", None, None)
    assert tuple(rules.spec(("vocab", "embed"), shape=(256, 64))) == (None, None)


def _hidden_gathers(logits, n, seq=128, d_model=64):
    """Per-device elements of the all-gathers of hidden states [n, seq, d_model]
    (one sequence per device, so the gathered batch is n), and the step's lint."""
    plan = sk.Plan(FSDP.with_logits(logits), devices=jax.devices()[:n])
    report = build_report(plan, model=models.get("gpt-tiny", remat="full"), batch=n, seq=seq)
    shape = (n, seq, d_model)
    gathers = [c for c in report.collectives if c.kind == "all-gather" and c.shape == shape]
    return gathers, [w for w in report.warnings if w.startswith("activation grows")]


@pytest.fixture(scope="module")
def compiled():
    return {(lg, n): _hidden_gathers(lg, n) for lg, n in (("vocab", 4), ("vocab", 8), ("auto", 8))}


def test_vocab_split_gathers_hidden_states_that_grow_with_the_devices(compiled):
    # gpt-tiny (vocab 256), one sequence of 128 per device: 512 tokens on 4 devices, 1,024
    # on 8, past the vocabulary. Split over the vocabulary, each device gathers the hidden
    # states of every token: T_g x d_model = N x 128 x 64 f32, twice as much on 8 devices.
    for n in (4, 8):
        gathers, lint = compiled["vocab", n]
        assert gathers and gathers[0].bytes == n * 128 * 64 * 4
        assert len(lint) == 1
    # Chosen per step, the logits split over the tokens: no such gather, no warning.
    assert compiled["auto", 8] == ([], [])


def test_lint_names_the_tensor_the_rule_and_the_fix(compiled):
    [warning] = compiled["vocab", 8][1]
    assert "logits (batch, length, vocab)" in warning
    assert "hidden states of 1,024 tokens" in warning
    assert "('vocab', 'fsdp')" in warning and "vocabulary 256" in warning
    assert "with_logits('auto')" in warning
    assert re.search(r"gathers them: f32\[8,128,64\]", warning)  # found in the program
