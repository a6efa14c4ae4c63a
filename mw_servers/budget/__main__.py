"""Serve ReplyBudget: ``python -m mw_servers.budget --address HOST:PORT --token-budget N``.

Every setting comes from, in this order of precedence: a command-line flag, an environment
variable ``AGENTMW_BUDGET_<SETTING>`` (e.g. ``AGENTMW_BUDGET_TOKEN_BUDGET=5000``), a YAML file
given with ``--config`` (keys as the flags, with underscores: ``token_budget: 5000``), the default.
Invalid settings are one line on stderr naming where they came from, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from agentmw.commandline import description
from agentmw.configfile import read_yaml
from agentmw.errors import ConfigError
from agentmw.sdk import serve
from agentmw.transport import check_listen_address

from . import DEFAULT_HINT, DEFAULT_KEY, NUMBERS, ReplyBudget, check_setting

PROG = "python -m mw_servers.budget"
ENV_PREFIX = "AGENTMW_BUDGET_"
DEFAULTS: dict[str, Any] = {
    "address": "127.0.0.1:50062",
    "token_budget": None,  # required
    "input_token_weight": 1.0,
    "output_token_weight": 1.0,
    "hint_message": DEFAULT_HINT,
    "key": DEFAULT_KEY,
}


class SettingError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=description(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # No defaults here: an unset flag falls back to the environment, then the config file.
    parser.add_argument("--address", help=f"host:port to listen on, port 0 = any (default {DEFAULTS['address']})")
    parser.add_argument("--token-budget", help="weighted tokens a reply may spend before tools are withheld")
    parser.add_argument("--input-token-weight", help="weight of a model call's input tokens (default 1)")
    parser.add_argument("--output-token-weight", help="weight of a model call's output tokens (default 1)")
    parser.add_argument("--hint-message", help="the hint added to the context once the budget is spent")
    parser.add_argument("--key", help=f"the middle_context slot, distinct per stacked budget (default {DEFAULT_KEY})")
    parser.add_argument("--config", help="a YAML file with any of the settings above")
    return parser


def _from_file(path: str, given: str) -> dict[str, Any]:
    """The settings in file ``path``, named by ``given`` (the flag or variable) in errors."""
    try:
        data = read_yaml(path) or {}
    except ConfigError as exc:
        raise SettingError(f"{given} {exc}") from None
    if not isinstance(data, dict):
        raise SettingError(f"{given} {path}: expected a mapping of settings")
    unknown = sorted(set(data) - set(DEFAULTS))
    if unknown:
        raise SettingError(f"{given} {path}: unknown settings {', '.join(unknown)} (known: {', '.join(DEFAULTS)})")
    return data


def settings(argv: list[str] | None, environ: dict[str, str]) -> dict[str, Any]:
    """The merged, validated settings (flags > environment > config file > defaults)."""
    args = vars(_parser().parse_args(argv))
    flag = args.pop("config")
    config, given = (flag, "--config") if flag else (environ.get(ENV_PREFIX + "CONFIG"), ENV_PREFIX + "CONFIG")
    merged = dict(DEFAULTS)
    where = {name: f"{name} (default)" for name in DEFAULTS}  # what an error names: where it came from
    if config:
        for name, value in _from_file(config, given).items():
            merged[name], where[name] = value, f"{name} in {given} {config}"
    for name in DEFAULTS:
        if (value := environ.get(ENV_PREFIX + name.upper())) is not None:
            merged[name], where[name] = value, ENV_PREFIX + name.upper()
        if args[name] is not None:
            merged[name], where[name] = args[name], "--" + name.replace("_", "-")
    if merged["token_budget"] is None:
        raise SettingError(f"--token-budget is required (or {ENV_PREFIX}TOKEN_BUDGET, or token_budget in --config)")
    for name, value in merged.items():
        try:
            merged[name] = _checked(name, value)
        except ValueError as exc:
            raise SettingError(f"{where[name]} {exc}") from None
    return merged


def _checked(name: str, value: Any) -> Any:
    """One setting, as given (text from a flag or variable, or YAML), checked: ReplyBudget's own
    check, and the address serve() would refuse only at start (exit 1, not 2)."""
    if name == "address":
        if not isinstance(value, str):
            raise ValueError(f"must be HOST:PORT, got {type(value).__name__} {value!r}")
        return check_listen_address(value)
    if name in NUMBERS:
        try:
            value = float(value) if isinstance(value, str) else value
        except ValueError:
            raise ValueError(f"must be a number, got {value!r}") from None
        return float(check_setting(name, value))
    return check_setting(name, value)


def main(argv: list[str] | None = None) -> None:
    try:
        s = settings(argv, dict(os.environ))
    except SettingError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    address = s.pop("address")
    serve(ReplyBudget(**s), address)


if __name__ == "__main__":
    main()
