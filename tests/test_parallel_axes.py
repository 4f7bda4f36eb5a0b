"""The registry of parallel axes (utils.parallel_axes): what the schema, the rank layout, the
process groups and the layout derive from agrees with it."""

from __future__ import annotations

import pytest
from helpers import CONFIG_FILE

from distributed.rank_generator import RankGenerator
from utils.config import flag_parser, load_yaml, read_config
from utils.config_schema import Config
from utils.parallel_axes import (
    AXES,
    DEFAULT_ORDER,
    GROUPS,
    LAYOUT_KEYS,
    MODEL_PARALLEL,
    MODEL_PARALLEL_KEYS,
    config_sizes,
    is_model_parallel,
    model_parallel_size,
    mp_ens_size,
    parse_axes,
    split_family,
)


def test_every_model_parallel_axis_is_a_schema_key_and_a_flag_of_the_model_parallel_scripts():
    flags = flag_parser("test", model_parallel=True).parse_args([])
    for axis in AXES:
        if axis.key is None:  # dp: what the world leaves, never configured
            assert not axis.model_parallel
            continue
        assert Config.model_fields[axis.key].default == 1, axis
        assert hasattr(flags, axis.key), axis
    assert MODEL_PARALLEL_KEYS == ("tp", "cp", "h_parallel_size", "w_parallel_size")
    assert LAYOUT_KEYS == (*MODEL_PARALLEL_KEYS, "ensemble_parallel_size")
    assert Config.model_fields["parallel_order"].default == DEFAULT_ORDER == "tp-cp-h-w-ens-dp"
    # ens splits no model: train.py (data parallel) has its flag too
    assert hasattr(flag_parser("test").parse_args([]), "ensemble_parallel_size")


def test_groups_are_each_axis_each_model_parallel_family_and_the_whole_replica():
    assert GROUPS == {"tp": ("tp",), "cp": ("cp",), "h": ("h",), "w": ("w",), "ens": ("ens",),
                      "dp": ("dp",), "tp-cp": ("tp", "cp"), "h-w": ("h", "w"),
                      "mp": MODEL_PARALLEL, "mp-ens": (*MODEL_PARALLEL, "ens")}
    assert MODEL_PARALLEL == ("tp", "cp", "h", "w")
    # every group the job builds is a partition of the world into groups of its size
    gen = RankGenerator({"tp": 2, "cp": 3, "dp": 2})
    for name in GROUPS:
        groups = gen.get_ranks(name)
        assert sorted(r for g in groups for r in g) == list(range(12)), name
        assert {len(g) for g in groups} == {gen.group_size(name)}, name
    assert gen.group_size("mp") == 6 and gen.get_ranks("mp") == gen.get_ranks("tp-cp")
    # ens: its ranks hold the same samples as their mp partners, so "mp-ens" is all but dp
    gen = RankGenerator({"tp": 2, "ens": 2, "dp": 2})
    assert gen.get_ranks("ens") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("mp-ens") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mp_ens_size(gen.sizes) == 4 and model_parallel_size(gen.sizes) == 2


def test_a_config_says_which_family_splits_its_model():
    tiny = read_config(CONFIG_FILE, "tiny", environ={})
    afno = read_config(CONFIG_FILE, "tiny_afno", environ={})
    assert config_sizes(tiny) == {"tp": 1, "cp": 1, "h": 1, "w": 1, "ens": 1}
    assert split_family(config_sizes(tiny)) is None and not is_model_parallel(config_sizes(tiny))
    vit = config_sizes(tiny.replace(tp=2, cp=2))
    assert split_family(vit) == "tensor" and model_parallel_size(vit) == 4
    mesh = config_sizes(afno.replace(h_parallel_size=2))
    assert split_family(mesh) == "spatial" and is_model_parallel(mesh)
    with pytest.raises(ValueError, match="more than one way"):
        split_family({"tp": 2, "h": 2})
    # an ensemble split over ranks splits no model
    ens = config_sizes(tiny.replace(loss="crps", ensemble_size=4, ensemble_parallel_size=2,
                                    parallel_order="tp-cp-ens-dp"))
    assert split_family(ens) is None and not is_model_parallel(ens) and mp_ens_size(ens) == 2


@pytest.mark.parametrize("name", sorted(load_yaml(CONFIG_FILE)))
def test_every_stock_config_places_every_axis_so_each_parallel_flag_works_on_it(name):
    cfg = read_config(CONFIG_FILE, name, environ={})
    assert sorted(parse_axes(cfg.parallel_order)) == sorted(a.name for a in AXES), name
    split = {"tp": 2} if cfg.model == "vit" else {"h_parallel_size": 2, "w_parallel_size": 2}
    ensemble = {"ensemble_size": 4, "loss": "crps", "ensemble_parallel_size": 2}
    for flags in (split, ensemble, {**split, **ensemble}):
        assert read_config(CONFIG_FILE, name, environ={}, flags=flags).parallel_order == \
            cfg.parallel_order
