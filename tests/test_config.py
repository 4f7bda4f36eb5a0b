"""config/ViT.yaml, its loading (utils.config) and the command-line flags derived from the
schema."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import CONFIG_FILE, one_line

from networks.vit import (
    VisionTransformer,
    count_parameters,
    training_flops_per_sample,
    vit_from_params,
)
from training.setup import batch_sizes
from utils.config import DATA_PATH_KEYS, FlagError, flag_parser, load_config, load_yaml, read_config
from utils.config_schema import Config
from utils.errors import ConfigError

NO_ENV: dict[str, str] = {}


def params_for(name: str, environ: dict[str, str] | None = None) -> Config:
    return read_config(CONFIG_FILE, name, environ=NO_ENV if environ is None else environ)


def cli(argv: list[str]) -> Config:
    return load_config(["--yaml_config", str(CONFIG_FILE), *argv], "test")


@pytest.fixture(scope="module")
def every_section() -> dict[str, Config]:
    """Every section of config/ViT.yaml, loaded once for the tests that sweep them all (each
    load parses the file); read only."""
    return {name: params_for(name) for name in load_yaml(CONFIG_FILE)}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATA_DIR", raising=False)
    monkeypatch.delenv("LOG_DIR", raising=False)


# ----------------------------------------------------------------- anchors and merge keys

def test_merge_keys_resolve_through_the_anchor_chain_cpu_bs64_opt_cpu_opt_cpu_base_base():
    p = params_for("cpu_bs64_opt")
    # its own keys
    assert p.global_batch_size == 64 and p.lr == pytest.approx(1.0e-3)
    # from cpu_opt
    assert (p.data_loader_config, p.num_data_workers, p.amp_mode, p.num_iters,
            p.enable_fused) == ("dali", 2, "auto", 1200, True)
    # from cpu_base
    assert (p.img_size, p.embed_dim, p.depth, p.expdir) == ([64, 128], 192, 6, "logs")
    assert p.train_data_path == "datasets/synthetic/train"
    # from base
    assert (p.dt, p.optimizer, p.betas, p.patch_size, p.num_heads) == (1, "Adam", [0.9, 0.95],
                                                                      8, 8)
    assert p.config == "cpu_bs64_opt" and p.yaml_config == str(CONFIG_FILE)


def test_every_section_is_a_complete_mapping_with_the_base_keys(every_section):
    base_keys = set(load_yaml(CONFIG_FILE)["base"])
    for name, p in every_section.items():
        missing = base_keys - set(p.model_dump())
        assert not missing, f"{name} lacks {sorted(missing)}"


def _scaling_sections(names) -> list[tuple[str, int]]:
    out = []
    for name in names:
        m = re.fullmatch(r"(?:cpu_)?bs(\d+)_opt|(?:cpu_)?mp_bs(\d+)", name)
        if m:
            out.append((name, int(m.group(1) or m.group(2))))
    return out


def test_bsN_opt_and_cpu_bsN_opt_follow_sqrt_lr_scaling_within_1_percent(every_section):
    sections = _scaling_sections(every_section)
    names = {n for n, _ in sections}
    for n in (16, 32, 64, 128, 256, 512, 1024, 2048):
        assert f"bs{n}_opt" in names and f"cpu_bs{n}_opt" in names
    for name, n in sections:
        p = every_section[name]
        assert p.global_batch_size == n, name
        expected = 5e-4 * math.sqrt(n / 16)
        assert p.lr == pytest.approx(expected, rel=0.01), f"{name}: lr {p.lr} vs {expected}"
    for name in ("mp", "cpu_mp"):  # batch 64
        assert every_section[name].lr == pytest.approx(5e-4 * math.sqrt(64 / 16), rel=0.01)


def test_cpu_bsN_opt_mirror_the_gpu_bsN_opt_batch_and_lr(every_section):
    for name, _ in _scaling_sections(every_section):
        if name.startswith("bs"):
            gpu, cpu = every_section[name], every_section["cpu_" + name]
            assert (gpu.global_batch_size, gpu.lr) == (cpu.global_batch_size, cpu.lr)


# ----------------------------------------------------------------- CPU size facts

def test_cpu_base_sizes():
    p = params_for("cpu_base")
    assert p.img_size == [64, 128]
    assert (p.patch_size, p.embed_dim, p.depth, p.num_heads) == (8, 192, 6, 8)
    assert p.global_batch_size == 16 and p.lr == pytest.approx(5e-4)
    assert (p.n_in_channels, p.n_out_channels) == (20, 20)


def test_cpu_model_has_3_187_136_params_and_2_64_gflop_per_training_sample():
    p = params_for("cpu_base")
    tokens = (64 // 8) * (128 // 8)
    assert tokens == 128
    n = count_parameters(p.embed_dim, p.depth, p.patch_size, p.n_in_channels,
                         p.n_out_channels, tokens)
    assert n == 3_187_136
    torch.manual_seed(0)
    model = vit_from_params(p)
    assert sum(q.numel() for q in model.parameters()) == 3_187_136
    assert round(n / 1e6, 1) == 3.2
    flops = training_flops_per_sample(tuple(p.img_size), p.patch_size, p.n_in_channels,
                                      p.n_out_channels, p.embed_dim, p.depth)
    assert round(flops / 1e9, 2) == 2.64


def test_cpu_short_runs_128_iters_on_limited_samples():
    p = params_for("cpu_short")
    assert p.num_iters == 128
    assert (p.limit_nsamples, p.limit_nsamples_val) == (512, 128)
    assert p.img_size == [64, 128] and p.embed_dim == 192


def test_cpu_mp_model_is_bigger_than_cpu_base():
    base, mp = params_for("cpu_base"), params_for("cpu_mp")
    assert mp.embed_dim > base.embed_dim
    assert mp.embed_dim % mp.num_heads == 0

    def size(p: Config) -> int:
        tokens = (p.img_size[0] // p.patch_size) * (p.img_size[1] // p.patch_size)
        return count_parameters(p.embed_dim, p.depth, p.patch_size, p.n_in_channels,
                                p.n_out_channels, tokens)

    assert size(mp) > 4 * size(base)
    assert params_for("cpu_mp_patch4").patch_size == 4
    assert params_for("cpu_short_mp").embed_dim == mp.embed_dim


def test_cpu_mp_patch4_mirrors_mp_patch4():
    """Patch 4 quadruples the sequence; with no data parallelism left (cp 2 on 2 processes,
    the README's step 9) the batch is mp_patch4's, the lr by the square-root rule."""
    cpu, gpu, mp = params_for("cpu_mp_patch4"), params_for("mp_patch4"), params_for("cpu_mp")

    def tokens(p: Config) -> int:
        return (p.img_size[0] // p.patch_size) * (p.img_size[1] // p.patch_size)

    assert cpu.patch_size == gpu.patch_size == 4 and tokens(cpu) == 4 * tokens(mp)
    assert (cpu.global_batch_size, cpu.lr) == (gpu.global_batch_size, gpu.lr) == (4, 2.5e-4)
    assert cpu.embed_dim == mp.embed_dim


def test_tiny_config_is_small_and_consistent():
    p = params_for("tiny")
    assert p.img_size == [16, 32] and p.patch_size == 4
    assert p.img_size[0] % p.patch_size == 0 and p.img_size[1] % p.patch_size == 0
    assert p.embed_dim % p.num_heads == 0
    model = VisionTransformer(tuple(p.img_size), p.patch_size, 20, 20, p.embed_dim, p.depth,
                              p.num_heads)
    assert sum(q.numel() for q in model.parameters()) < 100_000


def test_None_strings_become_None():
    p = params_for("base")
    assert p.limit_nsamples is None and p.limit_nsamples_val is None
    assert params_for("cpu_opt").limit_nsamples is None
    assert params_for("cpu_short").limit_nsamples == 512


# ----------------------------------------------------------------- environment overrides

def test_DATA_DIR_relocates_every_data_path_and_LOG_DIR_replaces_expdir():
    p = params_for("cpu_short", {"DATA_DIR": "/tmp/d/", "LOG_DIR": "/tmp/l"})
    assert p.data_dir == "/tmp/d/"
    assert p.train_data_path == "/tmp/d/train"
    assert p.valid_data_path == "/tmp/d/valid"
    assert p.inf_data_path == "/tmp/d/test"
    assert p.time_means_path == "/tmp/d/stats/time_means.npy"
    assert p.global_means_path == "/tmp/d/stats/global_means.npy"
    assert p.global_stds_path == "/tmp/d/stats/global_stds.npy"
    assert p.expdir == "/tmp/l"
    full = params_for("bs64_opt", {"DATA_DIR": "mydata"})
    assert [getattr(full, k) for k in DATA_PATH_KEYS] == [
        "mydata/train", "mydata/valid", "mydata/test", "mydata/stats/time_means.npy",
        "mydata/stats/global_means.npy", "mydata/stats/global_stds.npy"]
    assert full.expdir == "/logs"


def test_without_DATA_DIR_or_LOG_DIR_the_config_paths_are_kept():
    p = params_for("cpu_base", {"DATA_DIR": "", "LOG_DIR": ""})
    assert p.train_data_path == "datasets/synthetic/train" and p.expdir == "logs"


def test_environment_overrides_come_from_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("DATA_DIR", "/elsewhere")
    monkeypatch.setenv("LOG_DIR", "/runs")
    p = read_config(CONFIG_FILE, "cpu_base")
    assert p.valid_data_path == "/elsewhere/valid" and p.expdir == "/runs"


def test_a_config_is_frozen_and_replace_makes_a_checked_copy():
    p = params_for("tiny")
    with pytest.raises(ValueError, match="frozen"):
        p.lr = 0.5
    q = p.replace(lr=0.5)
    assert (q.lr, p.lr) == (0.5, params_for("tiny").lr)
    with pytest.raises(ConfigError, match="lr"):
        p.replace(lr=-1.0)
    with pytest.raises(AttributeError, match="nope"):
        _ = p.nope


# ----------------------------------------------------------------- command line

def test_cli_flags_override_the_config(clean_env):
    p = cli(["--config", "cpu_short", "--amp_mode", "fp16", "--num_iters", "7",
             "--enable_fused", "--enable_jit", "--num_data_workers", "3",
             "--data_loader_config", "pytorch", "--seed", "5", "--run_num", "run7",
             "--local_batch_size", "2"])
    assert (p.amp_mode, p.num_iters, p.enable_fused, p.enable_jit) == ("fp16", 7, True, True)
    assert (p.num_data_workers, p.data_loader_config, p.seed) == (3, "pytorch", 5)
    assert (p.run_num, p.local_batch_size) == ("run7", 2)


def test_cli_without_flags_keeps_the_config_values(clean_env):
    p = cli(["--config", "cpu_short_opt"])
    ref = params_for("cpu_short_opt")
    for key in ("amp_mode", "num_iters", "enable_fused", "enable_jit", "num_data_workers",
                "data_loader_config", "seed", "lr", "global_batch_size"):
        assert getattr(p, key) == getattr(ref, key), key
    assert p.local_batch_size is None and p.run_num is None
    assert cli([]).config == "cpu_short"  # the default config


def test_cli_rejects_a_bad_amp_mode_at_parse_time():
    with pytest.raises(FlagError) as e:
        flag_parser("test").parse_args(["--amp_mode", "fp8"])
    assert "fp8" in str(e.value) and e.value.usage.startswith("usage:")


def test_cli_rejects_non_positive_num_iters(clean_env):
    with pytest.raises(ConfigError) as e:
        cli(["--config", "tiny", "--num_iters", "0"])
    assert "num_iters" in one_line(e) and "0" in str(e.value)


def test_batch_sizes_divide_the_global_batch_over_data_parallel_ranks():
    p = params_for("cpu_bs64_opt")
    assert p.local_batch_size is None
    assert batch_sizes(p, 4) == (16, 64)


def test_batch_sizes_not_divisible_is_a_one_line_ConfigError_naming_the_numbers():
    p = params_for("cpu_base")
    with pytest.raises(ConfigError) as e:
        batch_sizes(p, 3)
    msg = one_line(e)
    assert "16" in msg and "3" in msg


def test_batch_sizes_local_batch_size_redefines_the_global_batch():
    p = params_for("cpu_base").replace(local_batch_size=2)
    assert batch_sizes(p, 4) == (2, 8)
    with pytest.raises(ConfigError) as e:  # checked with every other value, at start-up
        cli(["--config", "cpu_base", "--local_batch_size", "0"])
    assert "local_batch_size" in one_line(e)


def _config_with(tmp_path, extra: str):
    path = tmp_path / "ViT.yaml"
    path.write_text(CONFIG_FILE.read_text() + "\n" + extra + "\n")
    return path


def test_img_size_not_a_multiple_of_patch_size_is_a_ConfigError(tmp_path, clean_env):
    path = _config_with(tmp_path, "bad_img: {<<: *tiny, img_size: [18, 32]}")
    with pytest.raises(ConfigError) as e:
        load_config(["--yaml_config", str(path), "--config", "bad_img"], "t")
    msg = one_line(e)
    assert "18x32" in msg and "patch_size 4" in msg


def test_embed_dim_not_divisible_by_num_heads_is_a_ConfigError(tmp_path, clean_env):
    path = _config_with(tmp_path, "bad_heads: {<<: *tiny, embed_dim: 30}")
    with pytest.raises(ConfigError) as e:
        load_config(["--yaml_config", str(path), "--config", "bad_heads"], "t")
    assert "30" in one_line(e) and "num_heads 4" in str(e.value)


# ----------------------------------------------------------------- file and name errors

def test_unknown_config_name_is_a_ConfigError_listing_the_valid_names():
    with pytest.raises(ConfigError) as e:
        params_for("cpu_shrot")
    msg = one_line(e)
    assert "cpu_shrot" in msg
    for name in ("base", "cpu_short", "cpu_bs64_opt", "tiny", "bs2048_opt"):
        assert re.search(rf"\b{name}\b", msg), name


@pytest.mark.parametrize("text, line", [
    ("a:\n  lr: 1\nb: : :\n", 3),
    ("a:\n  betas: [0.9, 0.95\n  lr: 1\n", 3),
    ("a: &x\n  b: 1\nc:\n  <<: *y\n", 4),
])
def test_malformed_yaml_is_a_ConfigError_with_file_and_line(tmp_path, text, line):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_config(path, "a", environ=NO_ENV)
    assert f"{path}:{line}" in one_line(e)


def test_a_yaml_file_that_is_not_a_mapping_is_a_ConfigError(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError) as e:
        read_config(path, "a", environ=NO_ENV)
    assert str(path) in one_line(e)


def test_a_section_that_is_not_a_mapping_is_a_ConfigError(tmp_path):
    path = tmp_path / "scalar.yaml"
    path.write_text("a: 3\n")
    with pytest.raises(ConfigError) as e:
        read_config(path, "a", environ=NO_ENV)
    assert "'a'" in one_line(e)


def test_missing_config_file_is_a_ConfigError(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as e:
        read_config(path, "tiny", environ=NO_ENV)
    msg = one_line(e)
    assert str(path) in msg and "not found" in msg
