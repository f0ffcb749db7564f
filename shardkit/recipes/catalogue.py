"""The built-in recipes. Each is a small factory returning data.

Notation below: Ψ parameters, N devices on the sharded axis, f32 Adam state
(4Ψ params + 4Ψ grads + 8Ψ moments = 16Ψ bytes when replicated).
"""

from __future__ import annotations

from shardkit.recipes.recipe import Recipe
from shardkit.rules import Rules

__all__ = ["dp", "fsdp", "zero1"]

#: Names the reference models use for activations (see shardkit/models).
_REPLICATED_ACTIVATIONS = [("length", None), ("embed", None), ("heads", None), ("mlp", None)]


def dp() -> Recipe:
    """Data parallel: replicate the whole state, shard the batch over ``data``.

    Use when the state fits one device. Memory per device: 16Ψ bytes (f32 Adam)
    plus activations of B/N examples. Wire: one gradient all-reduce,
    2Ψ·4·(N−1)/N bytes per device per step.
    """
    return Recipe(
        name="dp",
        summary="data parallel: state replicated, batch sharded over 'data'",
        mesh_axes=(("data", -1),),
        rules=Rules([]),
        activation_rules=Rules([("batch", "data"), *_REPLICATED_ACTIVATIONS]),
    )


def fsdp() -> Recipe:
    """Fully sharded data parallel (ZeRO-3) over ``fsdp``.

    Parameters, gradients and optimizer state are sharded over ``fsdp`` (each
    matrix along ``embed``; the embedding along ``vocab``); XLA gathers each
    layer's weights when needed and reduce-scatters the gradients. Use when
    the state does not fit one device. Memory per device: 16Ψ/N bytes of state
    plus activations of B/N examples. Wire: 3Ψ·4·(N−1)/N bytes per device per
    step (two all-gathers of the weights, forward and backward, and one
    reduce-scatter of the gradients).
    """
    return Recipe(
        name="fsdp",
        summary="ZeRO-3: params, grads and optimizer state sharded over 'fsdp'",
        mesh_axes=(("fsdp", -1),),
        rules=Rules([("vocab", "fsdp"), ("embed", "fsdp")]),
        activation_rules=Rules([("batch", "fsdp"), *_REPLICATED_ACTIVATIONS]),
    )


def zero1() -> Recipe:
    """ZeRO-1: parameters replicated, optimizer state sharded over ``data``.

    Memory per device: 4Ψ params + 4Ψ grads + 8Ψ/N moments. Wire: as DP,
    2Ψ·4·(N−1)/N (a reduce-scatter of gradients and an all-gather of updated
    parameters replace the all-reduce).
    """
    return Recipe(
        name="zero1",
        summary="ZeRO-1: optimizer state sharded over 'data', params replicated",
        mesh_axes=(("data", -1),),
        rules=Rules([]),
        activation_rules=Rules([("batch", "data"), *_REPLICATED_ACTIVATIONS]),
        optimizer_rules=Rules([("vocab", "data"), ("embed", "data")]),
    )
