"""Fixtures shared by the reference-model tests.

Each test module names its model with a ``name`` fixture (``test_model.py`` parametrizes
it over both tiny models); ``model``, ``boxed``, ``params`` and ``init_loss`` follow from
it. A model's parameters and its initial loss are computed once per session and shared by
every module that asks for them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardkit as sk
from shardkit import models

B, S, V = 2, 16, 256


def _batch(seed=1):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "inputs": jax.random.randint(k1, (B, S), 0, V, jnp.int32),
        "targets": jax.random.randint(k2, (B, S), 0, V, jnp.int32),
    }


@functools.cache
def _boxed(name):
    return jax.jit(models.get(name).init)(jax.random.key(0))


@functools.cache
def _init_loss(name):
    return jax.jit(models.get(name).loss)(sk.unbox(_boxed(name)), _batch())


@pytest.fixture(scope="session")
def batch():
    """``int32[2, 16]`` random ``inputs`` and ``targets`` over the tiny vocabulary (256)."""
    return _batch()


@pytest.fixture(scope="module")
def model(name):
    return models.get(name)


@pytest.fixture(scope="module")
def boxed(name):
    return _boxed(name)


@pytest.fixture(scope="module")
def params(boxed):
    return sk.unbox(boxed)


@pytest.fixture(scope="module")
def init_loss(name):
    """The loss of the fresh params on ``batch`` (compiled once per session)."""
    return _init_loss(name)


@pytest.fixture(scope="module")
def check_unrolled(name, init_loss, batch):
    """``check_unrolled(unrolled)``: the scanned params, unstacked by the caller into its
    family's unrolled layout, have the structure of the ``scan=False`` model's params and
    give the scanned model's loss."""
    plain = models.get(name, scan=False, remat="full")
    expected = jax.tree.structure(
        jax.eval_shape(lambda k: sk.unbox(plain.init(k)), jax.random.key(0))
    )

    def check(unrolled):
        assert jax.tree.structure(unrolled) == expected
        np.testing.assert_allclose(jax.jit(plain.loss)(unrolled, batch), init_loss, rtol=1e-5)

    return check
