"""Building blocks that models and engines share: attention, RoPE, heads and losses, TSP's rings.

Everything here is a function of arrays and the active shardkit context (the activation
rules and the attention strategy a plan enters); nothing names a model or an engine, so
the reference models (:mod:`shardkit.models`), a model of your own and the pipeline
engine (:mod:`shardkit.parallel`) all build on it.

- :mod:`~shardkit.nn.attention`: causal attention (dense, ring, all-gather K/V);
- :mod:`~shardkit.nn.rope`: rotary position embeddings;
- :mod:`~shardkit.nn.segments`: packed rows' segment ids and positions, their mask;
- :mod:`~shardkit.nn.loss`: cross-entropy, the chunked vocabulary head and its gradient;
- :mod:`~shardkit.nn.mla`: multi-head latent attention (DeepSeek-V2), two TP layouts;
- :mod:`~shardkit.nn.moe`: a mixture-of-experts MLP, its router and expert parallelism;
- :mod:`~shardkit.nn.replicas`: one gradient all-reduce for a weight read twice;
- :mod:`~shardkit.nn.tsp`, :mod:`~shardkit.nn.tsp_head`: TSP's weight-shard and
  vocabulary rings.

Example:
  >>> import jax.numpy as jnp
  >>> from shardkit import nn
  >>> float(nn.loss.cross_entropy(jnp.zeros((1, 4)), jnp.zeros((1,), jnp.int32))[0])
  1.3862943649291992
"""

from shardkit.nn import attention, loss, mla, moe, replicas, rope, segments, tsp, tsp_head

__all__ = ["attention", "loss", "mla", "moe", "replicas", "rope", "segments", "tsp", "tsp_head"]
