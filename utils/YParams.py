"""Configuration: one named section of a YAML file (anchors and merge keys allowed)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError
from ruamel.yaml.nodes import Node, ScalarNode, SequenceNode

from utils.config_schema import validate
from utils.errors import ConfigError

# Keys whose value is a path under the config's `data_dir`; `DATA_DIR` relocates them.
DATA_PATH_KEYS = ("train_data_path", "valid_data_path", "inf_data_path",
                  "time_means_path", "global_means_path", "global_stds_path")


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
    return data


class YParams:
    """Attribute and item access to one config section: `params.lr`, `params['lr']`.

    The section, with `overrides` (command-line flags) on top, is checked against the
    schema (utils.config_schema) once; the values kept are the validated ones.
    """

    def __init__(self, yaml_file: str | os.PathLike, config_name: str,
                 environ: dict[str, str] | None = None,
                 overrides: dict[str, Any] | None = None):
        data = load_yaml(yaml_file)
        if config_name not in data:
            names = ", ".join(sorted(data))
            raise ConfigError(f"unknown config '{config_name}' in {yaml_file}; valid: {names}")
        section = data[config_name]
        if not isinstance(section, dict):
            raise ConfigError(f"config '{config_name}' in {yaml_file} is not a mapping")
        overrides = overrides or {}
        where = f"config '{config_name}' of {yaml_file}"
        valid = validate({**_plain(section), **overrides}, where, flags=set(overrides))
        self.__dict__["_params"] = valid
        self.update({"yaml_config": str(yaml_file), "config": config_name})
        self._apply_env(os.environ if environ is None else environ)

    def _apply_env(self, environ: Any) -> None:
        data_dir, log_dir = environ.get("DATA_DIR"), environ.get("LOG_DIR")
        if data_dir:
            old = str(self._params.get("data_dir", "")).rstrip("/")
            for key in DATA_PATH_KEYS:
                value = self._params.get(key)
                if isinstance(value, str) and old and value.startswith(old):
                    self[key] = data_dir.rstrip("/") + value[len(old):]
            self["data_dir"] = data_dir
        if log_dir:
            self["expdir"] = log_dir

    def __getattr__(self, key: str) -> Any:
        try:
            return self._params[key]
        except KeyError:
            raise AttributeError(f"config has no key '{key}'") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self._params[key] = value

    def __getitem__(self, key: str) -> Any:
        return self._params[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._params[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self._params

    def get(self, key: str, default: Any = None) -> Any:
        return self._params.get(key, default)

    def setdefault(self, key: str, default: Any) -> Any:
        return self._params.setdefault(key, default)

    def update(self, new: dict[str, Any]) -> None:
        self._params.update(new)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._params)

    def log(self, logger: logging.Logger | None = None) -> None:
        logger = logger or logging.getLogger(__name__)
        logger.info("------------------ Configuration ------------------")
        for key, value in sorted(self._params.items()):
            logger.info(f"{key}: {value}")
        logger.info("---------------------------------------------------")
