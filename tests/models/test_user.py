"""``models.load``: a user's model from ``package.module:factory``, in any form it comes."""

import sys
import types

import jax
import jax.numpy as jnp
import pytest

import shardkit as sk
from shardkit import models
from shardkit.report import build_report


def _init(rng):
    return {"w": jax.random.normal(rng, (16, 8))}


def _loss(params, batch):
    return jnp.mean(params["w"][batch["inputs"] % 16])


@pytest.fixture
def factory_module(monkeypatch):
    module = types.ModuleType("my_factories")
    module.as_mapping = lambda: {
        "init": _init,
        "loss": _loss,
        "vocab": 16,
        "annotations": [("w$", ("vocab", "embed"))],
    }
    module.as_pair = lambda: (_init, _loss)
    module.as_object = lambda: types.SimpleNamespace(init=_init, loss=_loss, vocab=16)
    module.as_user_model = lambda: models.UserModel(_init, _loss, vocab=16)
    module.as_nonsense = lambda: 42
    module.with_extra_keys = lambda: {"init": _init, "loss": _loss, "lr": 1e-3}
    monkeypatch.setitem(sys.modules, "my_factories", module)
    return module


@pytest.mark.parametrize("form", ["as_mapping", "as_pair", "as_object", "as_user_model"])
def test_every_form_a_factory_may_return(form, factory_module):
    m = models.load(f"my_factories:{form}")
    assert m.init is _init and m.loss is _loss and m.name == f"my_factories:{form}"
    if form == "as_mapping":
        assert m.vocab == 16 and m.annotations(_init(jax.random.key(0)))["w"] == ("vocab", "embed")
    if form == "as_user_model":
        assert m.vocab == 16 and m.dims is None


def test_a_loaded_model_reports_like_a_reference_one(factory_module):
    m = models.load("my_factories:as_mapping")
    report = build_report(sk.Plan("fsdp", annotations=m.annotations), model=m, batch=8, seq=4)
    w = next(r for r in report.params if r.path == "params/w")
    assert w.spec == "P('fsdp', None)" and w.bytes_per_device == 16 * 8 * 4 // 8
    assert report.workload.model == "my_factories:as_mapping" and report.workload.remat is None


def test_bad_factories_name_what_is_wrong(factory_module):
    with pytest.raises(sk.ShardingError, match="returned int"):
        models.load("my_factories:as_nonsense")
    with pytest.raises(sk.ShardingError, match=r"keys \['init', 'loss', 'lr'\]"):
        models.load("my_factories:with_extra_keys")
    with pytest.raises(sk.ShardingError, match=r"\['width'\] are not ModelDims fields"):
        models.UserModel(_init, _loss, dims={"width": 3})
    with pytest.raises(sk.ShardingError, match="must be callables"):
        models.UserModel(_init, "loss")


def test_resolve_picks_reference_names_or_factories(factory_module):
    assert models.resolve("gpt-tiny").name == "gpt-tiny"
    assert models.resolve("my_factories:as_pair").loss is _loss


def test_a_factory_returning_a_model_of_the_protocol_keeps_it_whole():
    """A reference model without a scanned stack (no cut) still loads, keeps its remat,
    and only a pipeline asks for its cut."""
    from shardkit.errors import NotPipelinableError
    from shardkit.models import get
    from shardkit.models.user import as_user_model

    model = get("gpt-tiny", scan=False, remat="full")
    loaded = as_user_model(model, name="pkg.mod:build")
    assert loaded is model and loaded.remat == "full"
    with pytest.raises(NotPipelinableError):
        loaded.stages()
