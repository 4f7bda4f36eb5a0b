"""Configuration: one named section of a YAML file (anchors and merge keys allowed)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError

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


def load_yaml(yaml_file: str | os.PathLike) -> dict[str, Any]:
    path = Path(yaml_file)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        with open(path) as f:
            data = YAML(typ="safe", pure=True).load(f)
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"malformed YAML in {where}: {e.problem or e.context}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must map config names to sections, got {type(data).__name__}")
    return data


class YParams:
    """Attribute and item access to one config section: `params.lr`, `params['lr']`."""

    def __init__(self, yaml_file: str | os.PathLike, config_name: str,
                 environ: dict[str, str] | None = None):
        data = load_yaml(yaml_file)
        if config_name not in data:
            names = ", ".join(sorted(data))
            raise ConfigError(f"unknown config '{config_name}' in {yaml_file}; valid: {names}")
        section = data[config_name]
        if not isinstance(section, dict):
            raise ConfigError(f"config '{config_name}' in {yaml_file} is not a mapping")
        self.__dict__["_params"] = {}
        self.update(_plain(section))
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
