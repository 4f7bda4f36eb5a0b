"""The config a script runs with: one named section of a YAML file (anchors and merge keys
allowed), the environment's relocations (`DATA_DIR`, `LOG_DIR`) and the command-line flags
on top, checked once against the schema (utils/config_schema.py) into a frozen `Config`.

    cfg = load_config(argv, "Train the weather forecaster")            # train.py
    cfg = load_config(argv, "...", model_parallel=True)                # + --tp, --cp, ...
    cfg = load_config(argv, "...", True, script="train_mp_graphs.py")  # + --graph_warmup
    cfg = read_config("config/ViT.yaml", "tiny", environ={})           # no flags (tests)

The flags are derived from the schema: every key marked `Flag()` there is a flag here, with
its type, choices and help, so a key is declared in one place. The scripts read their config
at start-up, before torch is imported (training/startup.py).
"""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError
from ruamel.yaml.nodes import Node, ScalarNode, SequenceNode

from utils.config_schema import KEYS, Config, Flag, ModelKeys, validate
from utils.errors import ConfigError
from utils.parallel_axes import LAYOUT_KEYS

DEFAULT_YAML = "./config/ViT.yaml"
DEFAULT_SECTION = "cpu_short"
# Keys whose value is a path under the config's `data_dir`; `DATA_DIR` relocates them.
DATA_PATH_KEYS = ("train_data_path", "valid_data_path", "inf_data_path",
                  "time_means_path", "global_means_path", "global_stds_path")


# ----------------------------------------------------------------------------- YAML

def _plain(value: Any) -> Any:
    """ruamel containers -> plain Python, and the tutorial's 'None' strings -> None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, str) and value.strip() == "None":
        return None
    return value


def _check_duplicate_keys(node: Node, path: Path, seen: set[int] | None = None) -> None:
    """A key given twice in one mapping is an error. ruamel finds most such keys itself, but
    not in a mapping with a merge key (`<<: *base`), where the last one would silently win."""
    seen = set() if seen is None else seen
    if isinstance(node, ScalarNode) or id(node) in seen:  # an alias: checked already
        return
    seen.add(id(node))
    if isinstance(node, SequenceNode):
        for item in node.value:
            _check_duplicate_keys(item, path, seen)
        return
    first: dict[str, ScalarNode] = {}
    for key, value in node.value:
        if isinstance(key, ScalarNode) and key.value in first:
            raise ConfigError(
                f"duplicate key '{key.value}' in {path}:{key.start_mark.line + 1} "
                f"(first at line {first[key.value].start_mark.line + 1}): give each key "
                "once per mapping")
        if isinstance(key, ScalarNode):
            first[key.value] = key
        _check_duplicate_keys(value, path, seen)


def load_yaml(yaml_file: str | os.PathLike) -> dict[str, Any]:
    """Every section of a YAML config file, as plain Python."""
    path = Path(yaml_file)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, expected a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    try:
        yaml = YAML(typ="safe", pure=True)
        _check_duplicate_keys(yaml.compose(text), path)
        data = yaml.load(text)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"malformed YAML in {where}: {e.problem or e.context}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must map config names to sections, got {type(data).__name__}")
    return _plain(data)


def relocate(section: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """`DATA_DIR` replaces the `data_dir` prefix of every data path, `LOG_DIR` the `expdir`:
    submit scripts and laptops share one config file."""
    out = dict(section)
    data_dir, log_dir = environ.get("DATA_DIR"), environ.get("LOG_DIR")
    if data_dir:
        old = str(out.get("data_dir", "")).rstrip("/")
        for key in DATA_PATH_KEYS:
            value = out.get(key)
            if isinstance(value, str) and old and value.startswith(old):
                out[key] = data_dir.rstrip("/") + value[len(old):]
        out["data_dir"] = data_dir
    if log_dir:
        out["expdir"] = log_dir
    return out


def read_config(yaml_file: str | os.PathLike, name: str,
                environ: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None) -> Config:
    """Section `name` of `yaml_file`, relocated by `environ` (default: os.environ), with the
    command-line `flags` (key: value) on top, checked against the schema."""
    data = load_yaml(yaml_file)
    if name not in data:
        raise ConfigError(f"unknown config '{name}' in {yaml_file}; valid: "
                          f"{', '.join(sorted(data))}")
    section = data[name]
    if not isinstance(section, dict):
        raise ConfigError(f"config '{name}' in {yaml_file} is not a mapping")
    flags = dict(flags or {})
    section = relocate(section, os.environ if environ is None else environ)
    # The flags that change a value of the section (or a default): they name the run.
    changed = {k: v for k, v in flags.items() if section.get(k, _default(k)) != v}
    source = {"config": name, "yaml_config": str(yaml_file), "flags": changed}
    return validate({**section, **flags, **source}, f"config '{name}' of {yaml_file}",
                    flags=set(flags))


def _default(key: str) -> Any:
    field = Config.model_fields.get(key)
    return None if field is None or field.is_required() else field.default


def saved_config(saved: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                 where: str = "checkpoint") -> Config:
    """The config a run saved (in its checkpoint), relocated by the environment as a YAML
    section is. Keys this version does not know are dropped (an older checkpoint)."""
    known = {k: v for k, v in saved.items() if k in Config.model_fields}
    known = relocate(known, os.environ if environ is None else environ)
    return validate(known, f"the config saved in {where}")


# What shapes a model: the model keys, and whether it is an ensemble (whose noise keys
# shape its noise layers; a deterministic model has none).
NOISE_KEYS = ("noise_channels", "noise_embed_dim")
MODEL_SHAPE_KEYS = (*(k for k in ModelKeys.model_fields if k not in NOISE_KEYS), "ensemble_size")
# Keys a run's flags may set that an evaluation chooses for itself: its rank layout.
LAYOUT_FLAGS = (*LAYOUT_KEYS, "parallel_order")


def run_config(yaml_file: str | os.PathLike, name: str, saved: Mapping[str, Any] | None,
               where: str, environ: Mapping[str, str] | None = None) -> Config:
    """Section `name` as a run trained with it (its config `saved` in its checkpoint
    `where`; None: an old checkpoint without one): the section with the flags the run was
    given on top (its rank layout's aside), so that what shapes the model is the run's.
    A key that shapes the model and still differs (the section changed since, or it is not
    the run's section) is a one-line ConfigError naming the key and what to do."""
    flags = {k: v for k, v in (saved or {}).get("flags", {}).items()
             if k in Config.model_fields and k not in LAYOUT_FLAGS}
    cfg = read_config(yaml_file, name, environ, flags)
    if not saved:
        return cfg
    ensemble = max(cfg.ensemble_size, int(saved.get("ensemble_size", 1))) > 1
    for key in (*MODEL_SHAPE_KEYS, *(NOISE_KEYS if ensemble else ())):
        if key not in saved or saved[key] == getattr(cfg, key):
            continue
        was, section = saved[key], saved.get("config")
        differs = f"config '{name}' has {key}={getattr(cfg, key)}, but {where} was trained"
        if section and section != name:
            raise ConfigError(f"{differs} from config '{section}' with {key}={was}: give "
                              f"--config={section}, or leave out --config to evaluate it "
                              "with the config saved in it")
        raise ConfigError(f"{differs} with {key}={was} (the section changed since): leave "
                          "out --config to evaluate it with the config saved in it, or set "
                          f"{key}: {was} in config '{name}' of {yaml_file}")
    return cfg


# ----------------------------------------------------------------------------- flags

class FlagError(ConfigError):
    """A flag argparse cannot parse. Raised on every rank: training/script_exit.py prints it once,
    as argparse would: the `usage` line, then `<prog>: error: <message>`."""

    def __init__(self, message: str, usage: str, prog: str):
        super().__init__(message, every_rank=True)
        self.usage, self.prefix = usage, f"{prog}: "


class FlagParser(argparse.ArgumentParser):
    """argparse's parser, raising FlagError where argparse would print and exit: in a job of
    many processes every rank parses the same command line, and one of them says so."""

    def error(self, message: str):
        raise FlagError(message, self.format_usage(), self.prog)


def _flag_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """(type, choices) of a flag from the key's annotation (None and bounds aside: the
    schema checks those, with messages that name the flag)."""
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    while hasattr(annotation, "__metadata__"):  # Annotated[...]
        annotation = get_args(annotation)[0]
    if get_origin(annotation) is Literal:
        choices = list(get_args(annotation))
        return type(choices[0]), choices
    return annotation, None


def flag_parser(description: str, model_parallel: bool = False,
                script: str | None = None) -> FlagParser:
    """The script's flags: --yaml_config and --config, then every key the schema marks as a
    flag (the model-parallel ones only for the model-parallel scripts, a script's own only
    for `script`)."""
    p = FlagParser(description=description)
    p.add_argument("--yaml_config", default=DEFAULT_YAML, help="the YAML config file")
    p.add_argument("--config", default=DEFAULT_SECTION, help="section of the YAML file")
    return add_flags(p, model_parallel, script=script)


def add_flags(p: argparse.ArgumentParser, model_parallel: bool = False,
              only: Sequence[str] | None = None, script: str | None = None
              ) -> argparse.ArgumentParser:
    """Add the schema's flags (`only` these keys, if given) to `p`: a flag not given parses
    as None, so that the config's value stands."""
    for key in KEYS:  # the schema's order (the reference's): it orders run names too
        field, flag = Config.model_fields[key], _flag(key)
        if flag is None or (flag.model_parallel and not model_parallel) or \
                (flag.script is not None and flag.script != script) or \
                (only is not None and key not in only):
            continue
        names = [f"--{key}", *flag.aliases]
        kind, choices = _flag_type(field.annotation)
        common = {"dest": key, "default": None, "help": field.description}
        if kind is bool:
            p.add_argument(*names, action="store_const", const=True, **common)
        elif flag.const is not None:
            p.add_argument(*names, nargs="?", const=flag.const, type=kind, **common)
        else:
            p.add_argument(*names, type=kind, choices=choices, **common)
    return p


def flags_given(args: argparse.Namespace) -> dict[str, Any]:
    """The keys the command line set, in the schema's order (a flag not given is None)."""
    return {key: value for key, value in vars(args).items()
            if value is not None and _is_flag(key)}


def _flag(key: str) -> Flag | None:
    """The key's `Flag` marker in the schema (None: no flag, or no such key)."""
    field = Config.model_fields.get(key)
    return next((m for m in field.metadata if isinstance(m, Flag)), None) if field else None


def _is_flag(key: str) -> bool:
    return _flag(key) is not None


# The keys whose flags the model-parallel scripts alone have: the layout (--tp, --cp, ...).
MODEL_PARALLEL_FLAGS = tuple(k for k in KEYS if (f := _flag(k)) is not None and f.model_parallel)


def load_config(argv: Sequence[str] | None, description: str,
                model_parallel: bool = False, script: str | None = None) -> Config:
    """The config of a script run with `argv`: the --config section of --yaml_config,
    relocated by the environment, with the flags given on top."""
    args = flag_parser(description, model_parallel, script).parse_args(argv)
    return read_config(args.yaml_config, args.config, flags=flags_given(args))
