"""Annotated reference models: GPT-2 (flax.linen), Llama, MoE Llama and DeepSeek (flax.nnx).

Every parameter carries logical axes (``@sk.axes`` on the module classes) and
activations are constrained at layer boundaries with ``sk.constrain``, so any
recipe can shard them. ``get(name, **overrides)`` gives a ``Model`` with
``init`` / ``apply`` / ``loss``.

Example:
  >>> from shardkit import models
  >>> models.names()
  ['gpt-tiny', 'gpt-small', 'gpt-1b', 'gpt-7b', 'llama-tiny', 'llama-small', 'llama-1b', 'llama-7b',
   'moe-tiny', 'moe-small', 'moe-47b', 'deepseek-tiny', 'deepseek-small']
  >>> models.get("llama-7b").config.param_count()
  6740512768
"""

from shardkit.models.config import CONFIGS, ModelConfig
from shardkit.models.model import Model, get, names
from shardkit.models.user import UserModel, load

__all__ = [
    "CONFIGS",
    "Model",
    "ModelConfig",
    "UserModel",
    "get",
    "load",
    "names",
    "resolve",
]


def resolve(name: str) -> Model | UserModel:
    """A reference model by name (``gpt-tiny``), or a user's by ``package.module:factory``.

    Example:
      >>> resolve("gpt-tiny").name, resolve("examples.my_model:build").vocab
      ('gpt-tiny', 256)
    """
    return load(name) if ":" in name else get(name)
