"""Tests for shardkit.report.flops: compiled FLOPs with loops weighted by trip counts.

Expected values are hand counts of the matmuls (``2·m·k·n`` each); the programs' other
work (a loop counter, a compare) is a few FLOPs per iteration.
"""

import jax
import jax.numpy as jnp
import pytest

import shardkit as sk
from shardkit import models
from shardkit.report import build_report
from shardkit.report.flops import compiled_flops

M, K = 16, 32
MATMUL = 2 * M * K * K


def compile_(f, *args):
    return jax.jit(f).lower(*args).compile()


def layer(x, w):
    return x @ w, None


def test_a_scanned_matmul_stack_counts_every_layer():
    ws, x = jnp.ones((12, K, K)), jnp.ones((M, K))
    got = compiled_flops(compile_(lambda ws, x: jax.lax.scan(layer, x, ws)[0], ws, x))
    assert got.exact
    assert got.flops == pytest.approx(12 * MATMUL, rel=1e-3)
    assert got.xla == pytest.approx(MATMUL, rel=1e-2)  # XLA's own: the body once


def test_nested_loops_multiply():
    ws, x = jnp.ones((3, 4, K, K)), jnp.ones((M, K))

    def outer(x, w4):
        return jax.lax.scan(layer, x, w4)[0], None

    got = compiled_flops(compile_(lambda ws, x: jax.lax.scan(outer, x, ws)[0], ws, x))
    assert got.flops == pytest.approx(3 * 4 * MATMUL, rel=1e-3)


def test_a_conditional_takes_its_costliest_branch_weighted():
    # One branch is a loop of 5 matmuls, the other one matmul: XLA's own count sees one
    # matmul in each.
    ws, x = jnp.ones((5, K, K)), jnp.ones((M, K))

    def f(p, ws, x):
        return jax.lax.cond(p, lambda: jax.lax.scan(layer, x, ws)[0], lambda: x @ ws[0])

    got = compiled_flops(compile_(f, True, ws, x))
    assert got.flops == pytest.approx(5 * MATMUL, rel=1e-2)
    assert got.xla == pytest.approx(MATMUL, rel=1e-2)


def test_rolled_and_unrolled_stacks_count_the_same():
    # Wide layers: the matmuls grow as k², the elementwise work the two differ in as k.
    k = 256
    ws, x = jnp.ones((8, k, k)), jnp.ones((M, k))

    def unrolled(ws, x):  # a list of layers: slicing a stack would add its gradient's pads
        for w in ws:
            x = jnp.tanh(x @ w)
        return x.sum()

    def rolled(ws, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0].sum()

    a = compiled_flops(compile_(jax.grad(unrolled, (0, 1)), list(ws), x))
    b = compiled_flops(compile_(jax.grad(rolled, (0, 1)), ws, x))
    assert a.flops == a.xla  # no loop: XLA's own count
    assert a.flops == pytest.approx(3 * 8 * 2 * M * k * k, rel=0.02)  # forward, dx, dw
    assert b.flops == pytest.approx(a.flops, rel=0.01)
    assert b.xla < 0.3 * a.flops


def test_the_report_counts_every_layer_of_a_scanned_model():
    # gpt-tiny scans its 4 layers; the report's FLOPs per device are PaLM's useful FLOPs
    # (6·Ψ + 12·L·d·s per token) and a little elementwise work (AdamW, softmax, norms):
    # measured 1.10x. XLA's own count sees one layer of the four.
    model = models.get("gpt-tiny", n_layers=4)
    d = model.dims
    r = build_report(sk.Plan("dp"), model=model, batch=8, seq=32)
    useful = (6 * d.param_count + 12 * d.layers * d.d_model * 32) * 32  # 32 tokens a device
    assert 1.0 <= r.flops / useful <= 1.2
