"""The config schema (utils.config_schema): every bad value, key or file is one ConfigError
line naming the culprit; good values come back normalised; the reference table is generated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import CONFIG_FILE, REPO, one_line

from tools import config_reference
from utils.config import load_config, read_config
from utils.config_schema import KEYS, describe, expected
from utils.errors import ConfigError


@pytest.fixture(autouse=True)
def no_env_relocation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATA_DIR", raising=False)
    monkeypatch.delenv("LOG_DIR", raising=False)


def config_file(tmp_path: Path, section: str) -> Path:
    """config/ViT.yaml plus a section `bad` (which may merge the file's anchors, *tiny)."""
    path = tmp_path / "config.yaml"
    path.write_text(CONFIG_FILE.read_text() + "\nbad:\n" + section + "\n")
    return path


def load(yaml_file: Path | str, argv: list[str] = (), config: str = "bad"):
    return load_config(["--yaml_config", str(yaml_file), "--config", config, *argv], "test",
                       model_parallel=True)


def tiny_without(key: str) -> str:
    """The `tiny` section spelled out in full (no merge key), less `key`."""
    values = read_config(CONFIG_FILE, "tiny", environ={}).model_dump()
    return "\n".join(f"  {k}: {json.dumps(v)}" for k, v in values.items()
                     if k not in (key, "config", "yaml_config", "flags"))


# (section `bad` of the config file, command-line flags, words the one line must hold);
# "{file}" stands for the config file's path.
TINY = "  <<: *tiny\n"
TINY_AFNO = "  <<: *tiny\n  model: afno\n  num_blocks: 4\n  parallel_order: tp-cp-h-w-dp\n"
CASES = {
    "lr_not_a_number": (TINY + '  lr: "abc"', [],
                        ["lr: 'abc'", "config 'bad' of {file}", "expected float > 0"]),
    "lr_negative": (TINY + "  lr: -1", [], ["lr: -1 ", "{file}", "expected float > 0"]),
    "img_size_not_a_list": (TINY + "  img_size: 16", [],
                            ["img_size: 16 ", "{file}", "expected list of 2 (int > 0)"]),
    "depth_not_an_integer": (TINY + "  depth: 2.5", [], ["depth: 2.5", "expected int > 0"]),
    "global_batch_size_a_word": (TINY + "  global_batch_size: four", [],
                                 ["global_batch_size: 'four'", "expected int > 0"]),
    "dropout_a_word": (TINY + "  dropout: high", [],
                       ["dropout: 'high'", "expected float in [0, 1)"]),
    "num_data_workers_negative_in_yaml": (TINY + "  num_data_workers: -1", [],
                                          ["num_data_workers: -1", "expected int >= 0"]),
    "section_without_num_iters": (tiny_without("num_iters"), [],
                                  ["config 'bad' of {file} has no 'num_iters'",
                                   "required: int > 0"]),
    "num_data_workers_flag_negative": (TINY, ["--num_data_workers", "-1"],
                                       ["--num_data_workers -1", "expected int >= 0"]),
    "seed_flag_negative": (TINY, ["--seed", "-1"],
                           ["--seed -1", "expected int in [0, 4294967295]"]),
    "parallel_order_flag_unknown": (TINY, ["--parallel_order", "foo"],
                                    ["--parallel_order foo", "axes from tp, cp, h, w, ens, dp"]),
    "duplicate_key_under_a_merge_key": (TINY + "  lr: 1.0e-3\n  lr: 2.0e-3", [],
                                        ["duplicate key 'lr'", "{file}:", "first at line"]),
    "lr_schedule_key_misspelled": (TINY + "  lr_shedule: constant", [],
                                   ["unknown key lr_shedule", "did you mean 'lr_schedule'?"]),
    "tutorial_wireup_key": (TINY + "  wireup_info: mpi", [],
                            ["key wireup_info: 'mpi' in config 'bad' of {file} is no longer "
                             "used", "found from the environment", "delete it"]),
    "lr_schedule_value_misspelled": (TINY + "  lr_schedule: cosin", [],
                                     ["lr_schedule: 'cosin'", "'cosine', 'constant'"]),
    "checkpoint_keep_flag_0": (TINY, ["--checkpoint_keep", "0"],
                               ["--checkpoint_keep 0", "expected int > 0"]),
    "checkpoint_keep_flag_negative": (TINY, ["--checkpoint_keep", "-1"],
                                      ["--checkpoint_keep -1", "expected int > 0"]),
    "checkpoint_interval_flag_negative": (TINY, ["--checkpoint_interval", "-1"],
                                          ["--checkpoint_interval -1", "expected int >= 0"]),
    "run_num_flag_climbs_out": (TINY, ["--run_num", "../../../x"],
                                ["--run_num ../../../x", "a single path component"]),
    "parallel_order_leaves_out_tp": (TINY, ["--tp", "2", "--parallel_order", "cp-dp"],
                                     ["parallel_order 'cp-dp' leaves out tp"]),
    # each model its own model parallelism: checked once, before any process group exists
    "afno_with_tp": (TINY_AFNO, ["--tp", "2"],
                     ["model afno splits its grid over h_parallel_size x w_parallel_size",
                      "got tp 2, cp 1"]),
    "fewer_outputs_than_inputs": (TINY + "  n_out_channels: 7", [],
                                  ["config 'bad' of {file}: n_out_channels 7 differs from "
                                   "n_in_channels 20", "each forecast is the next step's input"]),
    "vit_mlp_width_not_divisible_by_tp": (TINY + "  mlp_ratio: 1.03125", ["--tp", "2"],
                                          ["the MLP's 33 hidden units (embed_dim 32 x "
                                           "mlp_ratio 1.03125) are not divisible by tp 2"]),
    "vit_with_a_spatial_mesh": (TINY, ["--h_parallel_size", "2"],
                                ["h_parallel_size 2 x w_parallel_size 1 split the AFNO's grid",
                                 "model vit is split with tp and cp"]),
    "afno_more_h_ranks_than_token_rows": (TINY_AFNO, ["--h_parallel_size", "5"],
                                          ["h_parallel_size 5 is larger than the 4 token rows",
                                           "img_size 16x32 with patch_size 4"]),
    "afno_more_w_ranks_than_channel_blocks": (TINY_AFNO, ["--w_parallel_size", "8"],
                                              ["w_parallel_size 8 is larger than num_blocks 4"]),
    # ensembles: a CRPS of one member, members the ens ranks cannot share, an ensemble
    # trained with a deterministic loss; and the rank order that forgets ens
    "crps_with_one_member": (TINY + "  loss: crps", ["--ensemble_size", "1"],
                             ["loss crps scores an ensemble, but ensemble_size is 1",
                              "set ensemble_size > 1"]),
    "ensemble_not_divisible_by_ens": (TINY + "  loss: crps\n  parallel_order: tp-cp-ens-dp",
                                      ["--ensemble_size", "3", "--ensemble_parallel_size", "2"],
                                      ["ensemble_size 3 is not divisible by "
                                       "ensemble_parallel_size 2"]),
    "ensemble_with_mse": (TINY + "  loss: weighted_mse", ["--ensemble_size", "4"],
                          ["ensemble_size 4 trains an ensemble, which loss weighted_mse cannot "
                           "score", "use loss crps"]),
    "parallel_order_leaves_out_ens": (TINY + "  loss: crps\n  parallel_order: tp-cp-dp",
                                      ["--ensemble_parallel_size", "2"],
                                      ["parallel_order 'tp-cp-dp' leaves out ens",
                                       "ensemble_parallel_size > 1", "e.g. 'tp-cp-ens-dp'"]),
}


@pytest.mark.parametrize("name", CASES)
def test_each_bad_input_is_a_one_line_ConfigError_naming_the_culprit(tmp_path, name):
    section, argv, words = CASES[name]
    path = config_file(tmp_path, section)
    with pytest.raises(ConfigError) as e:
        load(path, argv)
    msg = one_line(e)
    for word in words:
        assert word.format(file=path) in msg, (word, msg)


def test_a_directory_as_yaml_config_is_named_as_a_directory(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, config="tiny")
    assert str(e.value) == f"config file {tmp_path} is a directory, expected a YAML file"


def test_a_duplicate_key_names_both_lines(tmp_path):
    path = config_file(tmp_path, TINY + "  lr: 1.0e-3\n  lr: 2.0e-3")
    lines = path.read_text().splitlines()
    again = len(lines)  # the second lr is the file's last line, the first one just above
    assert lines[again - 2:] == ["  lr: 1.0e-3", "  lr: 2.0e-3"]
    first = again - 1
    with pytest.raises(ConfigError, match=rf"{path}:{again} \(first at line {first}\)"):
        load(path)


def test_an_unknown_key_far_from_any_key_gets_no_suggestion(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(config_file(tmp_path, TINY + "  colour: blue"))
    assert "unknown key colour: 'blue'" in str(e.value)
    assert "did you mean" not in str(e.value)


def test_several_problems_name_the_first_and_list_the_other_keys(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(config_file(tmp_path, TINY + "  depth: 2.5\n  lr: x\n  dropout: 3"))
    assert str(e.value).startswith("bad value depth: 2.5")
    assert str(e.value).endswith("(also check dropout, lr)")  # in the schema's order


# ----------------------------------------------------------------- good input

def test_values_are_normalised_and_optional_keys_get_their_defaults(tmp_path):
    p = load(config_file(tmp_path, TINY + '  lr: "5E-4"\n  img_size: [16.0, 32]\n'
                                          "  limit_nsamples: None"))
    assert p.lr == 5e-4 and isinstance(p.lr, float)
    assert p.img_size == [16, 32] and all(isinstance(n, int) for n in p.img_size)
    assert p.limit_nsamples is None
    assert (p.model, p.rollout_steps, p.h_parallel_size, p.w_parallel_size) == ("vit", 1, 1, 1)
    assert (p.run_num, p.local_batch_size, p.checkpoint_keep) == (None, None, 3)
    assert (p.resume, p.requeue, p.noddp, p.bucket_cap_mb) == (None, False, False, 25)
    # every key of the schema, and nothing else (the flags given name the run directory)
    assert set(KEYS) == set(p.model_dump()) and p.flags == {}


def test_flags_are_checked_after_merging_so_a_flag_fixes_a_bad_yaml_value(tmp_path):
    p = load(config_file(tmp_path, TINY + "  num_data_workers: -1"),
             ["--num_data_workers", "2", "--checkpoint_interval", "0", "--seed", "0"])
    assert (p.num_data_workers, p.checkpoint_interval, p.seed) == (2, 0, 0)


def test_the_afno_key_family_is_accepted_and_checked(tmp_path):
    afno = TINY + ("  model: afno\n  num_blocks: 8\n  mlp_ratio: 2\n  sparsity_threshold: 0\n"
                   "  hard_thresholding_fraction: 0.5\n  amp_mode: auto\n  rollout_steps: 2\n"
                   "  h_parallel_size: 2\n  w_parallel_size: 8\n  parallel_order: h-w-dp")
    p = load(config_file(tmp_path, afno))
    assert (p.model, p.num_blocks, p.mlp_ratio, p.amp_mode) == ("afno", 8, 2.0, "auto")
    with pytest.raises(ConfigError, match="embed_dim 32 is not divisible by num_blocks 5"):
        load(config_file(tmp_path, afno.replace("num_blocks: 8", "num_blocks: 5")))
    with pytest.raises(ConfigError, match="w_parallel_size 9 is larger than the 8 token columns"):
        load(config_file(tmp_path, afno.replace("w_parallel_size: 8", "w_parallel_size: 9")))


def test_types_read_as_a_person_would_write_them():
    assert expected("seed") == "int in [0, 4294967295]"
    assert expected("hard_thresholding_fraction") == "float in (0, 1]"
    assert expected("limit_nsamples") == "int > 0 or None"
    assert expected("amp_mode") == "one of 'none', 'fp16', 'bf16', 'auto'"
    assert describe(str) == "str"


# ----------------------------------------------------------------- the reference table

def test_the_config_reference_in_the_docs_is_the_one_the_schema_generates():
    files = [f for f in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
             if config_reference.START in f.read_text()]
    assert files, "no file holds the config reference markers"
    for f in files:
        assert config_reference.between_markers(f.read_text()) == \
            config_reference.render().strip(), \
            f"{f.name} is stale: run python -m tools.config_reference --write {f.name}"


def test_the_reference_lists_every_key_once_and_write_replaces_the_old_table(tmp_path, capsys):
    config_reference.main([])
    printed = capsys.readouterr().out
    for key in KEYS:
        assert printed.count(f"| `{key}` |") == 1, key
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{config_reference.START}\nold table\n{config_reference.END}\nend\n")
    config_reference.main(["--write", str(doc)])
    assert doc.read_text() == (f"intro\n{config_reference.START}\n{printed.strip()}\n"
                               f"{config_reference.END}\nend\n")

