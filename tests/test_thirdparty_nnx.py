"""An NNX model holding ``nnx.Rngs`` (typed keys, dropout on), annotated the Flax way:
trains on 8 devices to the 1-device losses, laid out as ``nnx.get_partition_spec`` and
``nn.logical_to_mesh_axes`` predict; ``build_report`` counts its keys by their key data.
See ``flax_training.py`` and ``thirdparty_models.py``."""

import pytest
from flax_training import check_trains_as_flax_lays_it_out


@pytest.mark.parametrize("recipe", ["dp", "fsdp", "tp", "fsdp_tp"])
def test_an_nnx_model_with_rngs_trains_as_flax_lays_it_out(recipe):
    check_trains_as_flax_lays_it_out("nnx", recipe)
