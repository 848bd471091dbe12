import pytest

import sparsepatch as sp


@pytest.mark.parametrize("kwargs, name", [
    (dict(threshold=0.0), "threshold"), (dict(threshold=3), "threshold"), (dict(threshold=float("nan")), "threshold"),
    (dict(tile=(100, 128)), "tile"), (dict(tile=(0, 128)), "tile"), (dict(tile=128), "tile"),
    (dict(warmup_steps=-1), "warmup_steps"), (dict(layers="all"), "layers"),
])
def test_skip_config_rejects_bad_values_naming_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sp.SkipConfig(**kwargs)


def test_nsa_config_validation_and_defaults():
    cfg = sp.NSAConfig()
    assert (cfg.block_size, cfg.num_selected, cfg.window) == (64, 16, 512)
    with pytest.raises(ValueError, match="gates"):
        sp.NSAConfig(gates="random")
    with pytest.raises(ValueError, match="block_size"):
        sp.NSAConfig(block_size=0)


def test_skip_config_normalises_tile_and_must_do():
    cfg = sp.SkipConfig(tile=[64, 128], must_do=[[0, 10]])
    assert cfg.tile == (64, 128) and cfg.must_do == [(0, 10)]
