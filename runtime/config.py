"""Loading a TOML config file into a validated StoreConfig."""
from __future__ import annotations

import os
import sys

from tiers.config import StoreConfig
from tiers.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:   # pragma: no cover
    import tomli as tomllib


def load_config(path: str | os.PathLike, disk_path: str | None = None) -> StoreConfig:
    """Relative disk paths resolve against the config file's directory.
    ``disk_path`` (a command line's, relative to the working directory)
    replaces the file's disk directory before the config is checked, so
    that a directory the file names need not exist when it is overridden."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("config", f"file {os.fspath(path)!r} not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError("config", f"{os.fspath(path)}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError("config", f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    disk = data.get("tiers", {}).get("disk") if isinstance(data.get("tiers"), dict) else None
    if disk_path is not None and isinstance(disk, dict):
        disk["path"] = os.path.abspath(disk_path)
    return StoreConfig.from_dict(data, base_dir=os.path.dirname(os.path.abspath(path)))
