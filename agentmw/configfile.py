"""Reading a YAML configuration file: the host's ``--config`` and every built-in server's, so a
file that cannot be read or parsed is one line naming it (and the line of the YAML error).
PyYAML is imported when a file is read: it is the host's dependency, not the SDK's (sdk/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import ConfigError


def read_yaml(path: str | Path) -> Any:
    """The file's YAML document (None when it is empty), or ConfigError: "PATH: cannot read ..."
    or "PATH:LINE:COLUMN: malformed YAML: ..."."""
    import yaml  # only the host and the servers read YAML files: not a dependency of the SDK alone

    src = str(path)
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ConfigError(f"{src}: cannot read the configuration file ({exc.strerror or exc})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{src}:{mark.line + 1}:{mark.column + 1}" if mark is not None else src
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{at}: malformed YAML: {problem}") from None


__all__ = ["read_yaml"]
