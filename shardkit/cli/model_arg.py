"""``--model``: a reference model's name, or a user's ``package.module:factory``."""

from __future__ import annotations

from typing import Any

from shardkit import models

MODEL_HELP = (
    "a reference model (gpt-tiny, llama-small, ...; default: gpt-tiny) or your own as "
    "package.module:factory (e.g. examples.my_model:build)"
)

#: Default sequence length of a user's model (reference models: min(512, max_seq)).
USER_SEQ = 128


def resolve_model(name: str, *, remat: str | None = None) -> Any:
    """The model ``--model`` names, with ``--remat`` applied to a reference model.

    Raises:
      FlagError: an unknown reference model, or ``--remat`` for a model of one's own
        (its code decides what it rematerialises).
      ShardingError: a factory that cannot be loaded.
    """
    from shardkit.cli.fixes import FlagError, closest

    if ":" in name:
        if remat:
            raise FlagError(
                f"--remat {remat}: only the reference models take it; {name}'s own code "
                "decides what it rematerialises.",
                [{"--remat": None}],
            )
        return models.load(name)
    if name not in models.names():
        raise FlagError(
            f"--model {name}: no such reference model. Models: {', '.join(models.names())}, "
            "or your own as package.module:factory.",
            [{"--model": m} for m in closest(name, models.names())],
        )
    return models.get(name, **({"remat": remat} if remat else {}))


def default_seq(model: Any) -> int:
    """``min(512, max_seq)`` for a model whose dims declare ``max_seq`` (the reference
    models do); 128 otherwise."""
    dims = model.dims
    return min(512, dims.max_seq) if dims is not None and dims.max_seq else USER_SEQ
