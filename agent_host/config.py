"""Host configuration: a YAML file, then AGENTMW_* environment variables, then command-line flags,
each overriding the one before. Every problem is a ``ConfigError`` whose message says what is
wrong and where (file and key, variable, or flag), so the CLI can print it as one line.

YAML (every key optional)::

    listen: 127.0.0.1:50070        # host:port of the AgentHost gRPC service (port 0 = any free port)
    db: agentmw.db                 # SQLite session store (":memory:" keeps nothing), or a
                                   # postgresql:// DSN: a store many hosts share
    store: {dsn: postgresql://..., lease: 10}   # the same as db: DSN; lease: seconds a host holds
                                   # a session without renewing (a paused host loses it after)
    drain_grace: 30                # on SIGTERM, seconds the replies in flight get to finish
    log_level: info
    loop: asyncio                  # the event loop: asyncio, uvloop or auto (uvloop when installed)
    metrics_port: 9464             # Prometheus /metrics on the listen host (absent: none; 0 = any free port)
    agent: {name: assistant, system_prompt: "...", max_iters: 10,   # 0 or more (0: answer at once)
            inject_runtime_state: false, timezone: UTC}   # tell the model the time (docs/behaviour.md)
    models:                        # the model registry: ids -> provider settings
      default: offline
      models:
        offline: {provider: offline}
    tools: [get_weather, add, send_email, lookup_order]   # built-in demo tools to enable
    middleware:                    # onion order: first = outermost
      - {name: budget, address: 127.0.0.1:50062, fail_open: false, timeout: 10}
      # also per middleware: max_items / max_bytes, what one hook call may emit (100000 / 64 MiB),
      # max_item_bytes, the largest one item, tool chunk or slot value it may send (2 MiB);
      # key: the middle_context slot it must report in Describe (the host decides, not the server);
      # permissions: {hooks: [on_reply, ...], context: true, mutate_context: true, set_model: true,
      #               tools: true}   (each true / every hook by default; docs/security.md)
    tracing: {endpoint: http://127.0.0.1:4317}   # OTLP/gRPC spans (also: exporter, service_name);
                                   # without it the standard OTEL_* variables decide (docs/tracing.md)
    security:                      # all optional; none = plaintext, no authentication (loopback use)
      tls: {cert: host.pem, key: host.key, client_ca: ca.pem, require_client_cert: true}
      users:                       # authentication on: tokens (never in the file itself) or certificates
        - {name: alice, role: user, token_env: ALICE_TOKEN}       # also token_file, token_sha256
        - {name: ops, role: admin, cert_cn: ops}                  # mTLS identity (needs tls.client_ca)
      middleware_tls: {ca: ca.pem, cert: host-client.pem, key: host-client.key, server_name: localhost}
      middleware_token_env: AGENTMW_MIDDLEWARE_TOKEN   # presented to every middleware (or _file)
      attach_allow: ["10.0.0.*:50061"]   # AttachMiddleware targets; default: loopback + configured
      attach_permissions: {...}    # permissions of AttachMiddleware'd servers (default: all)
      reflection: false            # gRPC server reflection
    limits: {max_message_bytes: 4194304, sessions_per_owner: 1000, replies_per_owner: 8}
                                   # max_message_bytes: at most 2147483647 (gRPC's limit)

Every duration (timeouts, lease, drain_grace) is a finite number of seconds above 0 and at most
2592000 (30 days: MAX_SECONDS). A name may not be given twice in one list (tools, middleware,
the --middleware flags, AGENTMW_MIDDLEWARE).

Environment: AGENTMW_CONFIG (the YAML path), AGENTMW_LISTEN, AGENTMW_DB, AGENTMW_LOG_LEVEL,
AGENTMW_MODEL (default model id), AGENTMW_MIDDLEWARE ("name=host:port,name=host:port": --middleware
values, an ipv4:/ipv6: replica list keeping its commas; see split_middleware_list),
AGENTMW_METRICS_PORT, AGENTMW_LEASE, AGENTMW_DRAIN_GRACE.
AGENTMW_TLS_CERT / _KEY / _CLIENT_CA, AGENTMW_MIDDLEWARE_TLS_CA / _CERT / _KEY (file paths),
AGENTMW_MIDDLEWARE_TOKEN (the token itself).
Flags: --config, --listen, --db, --log-level, --model, --middleware name=host:port (repeatable),
--metrics-port, --lease, --drain-grace, --tls-cert, --tls-key, --tls-client-ca, --middleware-tls-ca,
--middleware-tls-cert, --middleware-tls-key.

Relative file paths in the YAML (db / store.dsn as a SQLite path, TLS files, token files, a model's
api_key_file) are relative to the YAML file's directory; those of flags and variables to the
working directory.

Middleware from the environment or flags overlay the YAML list by name: a name given again gets
the new address and keeps its YAML policy (fail_open, timeout); new names are appended in order.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentmw.configfile import read_yaml
from agentmw.data.state import checked_max_iters
from agentmw.errors import ConfigError  # re-exported: the loader raises it
from agentmw.loops import DEFAULT_LOOP, check_loop
from agentmw.tools import TOOL_NAME
from agentmw.transport import check_listen_address

from .security import ROLES, SecurityError, TlsFiles, User, read_secret, token_digest

DEFAULT_LISTEN = "127.0.0.1:50070"
DEFAULT_DB = "agentmw.db"
DEFAULT_TIMEOUT = 10.0
# Per-call output limits of a middleware (agent_host.remote.Policy): generous for a legit one (a TTS
# middleware streaming minutes of audio emits some 10k chunks and tens of MB), small enough to stop a
# runaway one in seconds; and one item (or tool chunk, slot value) in one piece, which reaches a
# client in one ReplyEvent (or a GetSession): a gRPC client accepts 4 MiB per message by default.
DEFAULT_MAX_ITEMS = 100_000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_ITEM_BYTES = 2 * 1024 * 1024
DEFAULT_LEASE = 10.0
DEFAULT_DRAIN_GRACE = 30.0
# The longest duration any setting, flag or RPC takes (check_seconds): 30 days. Far beyond a sane
# timeout, lease or grace period, and well within what a gRPC deadline holds (one of ~1e10 s
# overflows: every call with it failed at once as DEADLINE_EXCEEDED).
MAX_SECONDS = 30 * 24 * 3600.0
# grpc.max_receive_message_length is a C int: limits.max_message_bytes above it is an OverflowError.
MAX_MESSAGE_BYTES = 2**31 - 1

# The embedded default model: offline and deterministic, with rules that reach every demo tool
# from plain sentences ("What's the weather in Paris?", "email bob@example.com saying hi").
DEFAULT_MODELS: dict[str, Any] = {
    "default": "offline",
    "models": {
        "offline": {
            "provider": "offline",
            "rules": [
                {
                    "pattern": r"weather in ([A-Za-z][A-Za-z .'-]*[A-Za-z])",
                    "tool": "get_weather",
                    "input": {"city": "{0}"},
                },
                {
                    "pattern": r"e-?mail (\S+@[\w.-]*\w)\s+(?:saying|that|:)\s*(.+)",
                    "tool": "send_email",
                    "input": {"to": "{0}", "body": "{1}"},
                },
                {"pattern": r"order #?([A-Za-z0-9][\w-]*)", "tool": "lookup_order", "input": {"order_id": "{0}"}},
            ],
        }
    },
}
DEFAULT_TOOLS = ["get_weather", "add", "send_email", "lookup_order"]


@dataclass
class Permissions:
    """What a middleware may do (least privilege); checked where Describe is read and where its
    mutations are applied (agent_host/remote/client.py). Everything is allowed by default."""

    hooks: frozenset[str] | None = None  # hooks it may serve; None = every hook
    context: bool = True  # receive agent.state.context (wants_context)
    mutate_context: bool = True  # append / remove messages and blocks, set summary / cur_iter / max_iters
    set_model: bool = True
    tools: bool = True  # contribute tools (ToolSource)


@dataclass
class MiddlewareConfig:
    address: str
    name: str = ""  # "" = the middleware's Describe key
    key: str = ""  # "" = whatever Describe reports; else Describe must report exactly this key
    permissions: Permissions = field(default_factory=Permissions)
    fail_open: bool = False
    timeout: float = DEFAULT_TIMEOUT
    max_items: int = DEFAULT_MAX_ITEMS  # per hook call (agent_host.remote.Policy)
    max_bytes: int = DEFAULT_MAX_BYTES
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES  # one item, tool chunk or slot value
    source: str = ""  # where it was configured, for error messages


@dataclass
class SecurityConfig:
    """Transport security, authentication and limits (docs/security.md). The defaults are today's
    loopback setup: plaintext, no authentication, every caller an admin."""

    tls: TlsFiles = field(default_factory=TlsFiles)  # the host's server side; ca = client CA
    require_client_cert: bool = True  # with tls.ca: mutual TLS
    users: list[User] = field(default_factory=list)  # none = no authentication
    middleware_tls: TlsFiles = field(default_factory=TlsFiles)  # the host as a middleware client
    # The secret presented to middleware servers: never logged, stored or in a repr.
    middleware_token: str = field(default="", repr=False)
    attach_allow: list[str] | None = None  # None = loopback and configured addresses
    attach_permissions: Permissions = field(default_factory=Permissions)
    reflection: bool = False
    max_message_bytes: int = 4 * 1024 * 1024  # what the host accepts per message from a client
    sessions_per_owner: int = 1000  # with authentication: sessions one user may own
    replies_per_owner: int = 8  # with authentication: replies of one user running at once (all hosts of a shared store)


@dataclass
class HostConfig:
    listen: str = DEFAULT_LISTEN
    db: str = DEFAULT_DB  # a SQLite path, or a postgresql:// DSN
    lease: float = DEFAULT_LEASE  # seconds (shared store): a host that stops renewing loses a session after
    drain_grace: float = DEFAULT_DRAIN_GRACE  # seconds the replies in flight get to finish on SIGTERM
    log_level: str = "info"
    loop: str = DEFAULT_LOOP  # asyncio / uvloop / auto (agentmw/loops.py)
    metrics_port: int | None = None  # Prometheus /metrics (agent_host/metrics.py); None: not served
    agent_name: str = "assistant"
    system_prompt: str = "You are a helpful assistant."
    max_iters: int = 10
    inject_runtime_state: bool = False  # AgentScope's default is on; see docs/behaviour.md#runtime-state
    timezone: str = "UTC"
    models: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(DEFAULT_MODELS))
    tools: list[str] = field(default_factory=lambda: list(DEFAULT_TOOLS))
    middleware: list[MiddlewareConfig] = field(default_factory=list)
    tracing: dict[str, Any] = field(default_factory=dict)  # see agent_host/tracing.py
    security: SecurityConfig = field(default_factory=SecurityConfig)
    source: str = "defaults"  # the YAML file, when there is one
    # Where a setting's value came from, for its errors: "FILE: key", "environment NAME", "flag --x".
    origins: dict[str, str] = field(default_factory=dict)

    def build_models(self) -> Any:
        """The model registry; an unknown provider or a bad model setting is a ConfigError."""
        from .models.registry import ModelRegistry

        where = f"{self.source}: models" if self.source != "defaults" else "models"
        if "model" in self.origins:  # the default model's id was given there
            where = f"{where} (the default model: {self.origins['model']})"
        try:
            if not isinstance(self.models.get("models"), Mapping) or not self.models["models"]:
                raise ValueError("expected 'models: {<id>: {provider: ..., ...}}' with at least one model")
            registry = ModelRegistry.from_config(dict(self.models))
            registry.get(registry.default or "")  # an unknown (or no) default id raises here
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        return registry


# ---------------------------------------------------------------------------------------------
# Loading.


def load_config(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> HostConfig:
    """YAML < environment < flags. ``flags`` keys: listen, db, log_level, model, middleware (list)."""
    env = os.environ if env is None else env
    flags = flags or {}
    path = path or env.get("AGENTMW_CONFIG") or None
    cfg = HostConfig()
    if path:
        _apply_yaml(cfg, Path(path))
    layers = (
        (
            "environment",
            {
                "listen": "AGENTMW_LISTEN",
                "db": "AGENTMW_DB",
                "log_level": "AGENTMW_LOG_LEVEL",
                "loop": "AGENTMW_LOOP",
                "model": "AGENTMW_MODEL",
                "middleware": "AGENTMW_MIDDLEWARE",
                "metrics_port": "AGENTMW_METRICS_PORT",
                "lease": "AGENTMW_LEASE",
                "drain_grace": "AGENTMW_DRAIN_GRACE",
                **{key: "AGENTMW_" + key.replace(".", "_").upper() for key in _TLS_SETTINGS},
                "middleware_token": "AGENTMW_MIDDLEWARE_TOKEN",
            },
        ),
        (
            "flag",
            {
                "listen": "--listen",
                "db": "--db",
                "log_level": "--log-level",
                "loop": "--loop",
                "model": "--model",
                "middleware": "--middleware",
                "metrics_port": "--metrics-port",
                "lease": "--lease",
                "drain_grace": "--drain-grace",
                **{key: "--" + key.replace(".", "-").replace("_", "-") for key in _TLS_SETTINGS},
            },
        ),
    )
    for kind, names in layers:
        for key, name in names.items():
            raw = env.get(name) if kind == "environment" else flags.get(key)
            if raw is None or raw == "" or raw == []:
                continue
            where = cfg.origins[key] = f"{kind} {name}"
            if key == "middleware":
                items = split_middleware_list(raw) if isinstance(raw, str) else list(raw)
                named: set[str] = set()  # within one layer: a name given twice is a mistake, not an overlay
                for item in items:
                    new = parse_middleware_arg(item, where)
                    if new.name and new.name in named:
                        raise ConfigError(f"{where} {item.strip()!r}: the name {new.name!r} is used twice")
                    if new.name:
                        named.add(new.name)
                    _overlay_middleware(cfg, new)
            elif key == "metrics_port":
                cfg.metrics_port = _port(str(raw), where)
            elif key == "model":
                if not isinstance(cfg.models, dict):
                    cfg.models = {}
                cfg.models["default"] = str(raw)
            elif key in _SECONDS:
                setattr(cfg, key, _seconds(raw, where))
            elif key == "middleware_token":
                cfg.security.middleware_token = str(raw)
            elif key in _TLS_SETTINGS:
                group, attr = _TLS_SETTINGS[key]
                setattr(getattr(cfg.security, group), attr, str(raw))
            else:
                setattr(cfg, key, str(raw))
    _check_listen(cfg.listen, cfg.origins.get("listen", "listen"))
    if not isinstance(getattr(logging, cfg.log_level.upper(), None), int):
        raise ConfigError(f"{cfg.origins.get('log_level', 'log_level')}: unknown level {cfg.log_level!r}")
    try:
        check_loop(cfg.loop, "loop (YAML loop:, AGENTMW_LOOP or --loop)")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for group in ("tls", "middleware_tls"):
        # Where its files were given: the YAML keys, variables and flags (each once, in that order).
        given = dict.fromkeys(where for key, where in cfg.origins.items() if key.startswith(f"{group}."))
        try:
            getattr(cfg.security, group).check(", ".join(given) or f"security.{group}")
        except SecurityError as exc:
            raise ConfigError(str(exc)) from None
    for i, user in enumerate(cfg.security.users):
        # Without a client CA, or with require_client_cert: false, the host asks for no certificate
        # (gRPC Python cannot ask without requiring): a cert_cn alone never matches, and every call
        # of the user would fail UNAUTHENTICATED.
        if user.cert_cn and not user.token_sha256 and not (cfg.security.tls.ca and cfg.security.require_client_cert):
            raise ConfigError(
                f"{cfg.source}: security.users[{i}]: user {user.name!r} has only a cert_cn, which needs "
                "security.tls.client_ca (or --tls-client-ca / AGENTMW_TLS_CLIENT_CA) with "
                "require_client_cert: true to be checked"
            )
    for mw in cfg.middleware:
        if not mw.address:
            raise ConfigError(
                f"{mw.source}: middleware {mw.name!r} has no address "
                f"(give one in YAML or with --middleware {mw.name}=HOST:PORT)"
            )
    return cfg


# Flag / environment names of the TLS file paths: key -> (SecurityConfig field, TlsFiles field).
_TLS_SETTINGS = {
    "tls.cert": ("tls", "cert"),
    "tls.key": ("tls", "key"),
    "tls.client_ca": ("tls", "ca"),
    "middleware_tls.ca": ("middleware_tls", "ca"),
    "middleware_tls.cert": ("middleware_tls", "cert"),
    "middleware_tls.key": ("middleware_tls", "key"),
}


def parse_middleware_arg(text: str, where: str) -> MiddlewareConfig:
    """``name=host:port`` or a bare ``host:port`` (named by its Describe key)."""
    text = text.strip()
    name, sep, address = text.partition("=")
    if not sep:
        name, address = "", text
    name, address = name.strip(), address.strip()
    if not address or (sep and not name):
        raise ConfigError(f"{where}: {text!r} is not NAME=HOST:PORT")
    check_middleware_address(address, f"{where} {text!r}")
    try:
        check_middleware_name(name)
    except ValueError as exc:
        raise ConfigError(f"{where} {text!r}: {exc}") from None
    return MiddlewareConfig(address=address, name=name, source=where)


def split_middleware_list(text: str) -> list[str]:
    """AGENTMW_MIDDLEWARE's items, each a --middleware value (``NAME=ADDRESS`` or ``ADDRESS``),
    separated by commas. A replica list has commas of its own (``ipv4:h:1,h:2``): a piece without
    ``=`` that follows an ``ipv4:``/``ipv6:`` address is one more replica of it, not a middleware."""
    items: list[str] = []
    for piece in text.split(","):
        if not piece.strip():
            continue
        last = items[-1].rpartition("=")[2].strip() if items else ""  # the previous item's address
        if "=" not in piece and last.startswith(_LIST_TARGETS):
            items[-1] += "," + piece
        else:
            items.append(piece)
    return items


_LIST_TARGETS = ("ipv4:", "ipv6:")  # gRPC target names that list several addresses


def _overlay_middleware(cfg: HostConfig, new: MiddlewareConfig) -> None:
    for mw in cfg.middleware:
        if (new.name and mw.name == new.name) or (not new.name and mw.address == new.address):
            mw.address, mw.source = new.address, new.source
            return
    cfg.middleware.append(new)


def check_middleware_address(address: str, where: str) -> None:
    """A middleware's address as the host takes it: HOST:PORT or a gRPC target name (``dns:``,
    ``unix:``, ...); else a ConfigError naming ``where`` (also agentmw middleware attach's check)."""
    if "://" in address or address.startswith(("ipv4:", "ipv6:", "unix:", "dns:")):
        return  # a gRPC target name; the channel validates it
    _check_listen(address, where)


def _port(text: str, where: str) -> int:
    # ASCII digits only: isdigit() alone takes '²' (int() then fails with a traceback) and other
    # scripts' digits ('٣٠٠٠' was quietly port 3000).
    if not (text.strip().isascii() and text.strip().isdigit()) or int(text) > 65535:
        raise ConfigError(f"{where}: {text!r} is not a port number (0-65535)")
    return int(text)


def _check_listen(address: str, where: str) -> None:
    try:
        check_listen_address(address, unix=False)  # the host announces HOST:PORT
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# YAML.


_TOP_KEYS = {
    "listen",
    "db",
    "store",
    "drain_grace",
    "log_level",
    "loop",
    "metrics_port",
    "agent",
    "models",
    "tools",
    "middleware",
    "tracing",
    "security",
    "limits",
}
_SECONDS = {"lease", "drain_grace"}


def check_seconds(value: Any, what: str = "timeout") -> float:
    """A finite number of seconds above 0 (NaN, infinity, 0 or less would never or always expire)
    and at most MAX_SECONDS (30 days; a gRPC deadline of ~1e10 s overflows and expires at once):
    the one rule for every timeout, lease and grace period, in configuration, flags and RPCs."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of seconds above 0, got {value!r}")
    if value > MAX_SECONDS:
        raise ValueError(f"{what} must be at most {MAX_SECONDS:.0f} seconds (30 days), got {value!r}")
    return float(value)


def check_middleware_name(name: str) -> str:
    """A middleware's name: it prefixes its tools (``NAME__tool``, which models take only as 1-64
    of ``[a-zA-Z0-9_-]``) and names it in logs, metrics and the admin API. The one rule for the
    configuration, flags and AttachMiddleware. "" is allowed: the middleware's Describe key then."""
    if name and not TOOL_NAME.fullmatch(name):
        raise ValueError(f"middleware name {name!r} is not 1-64 of [a-zA-Z0-9_-] (it prefixes its tools)")
    return name


def _seconds(raw: Any, where: str) -> float:
    """A duration setting (YAML, or text from the environment or a flag), as ``check_seconds``."""
    try:
        value = float(raw) if isinstance(raw, str) else raw
    except ValueError:
        raise ConfigError(f"{where}: expected a number of seconds above 0, got {raw!r}") from None
    try:
        return check_seconds(value, where)
    except ValueError:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
            raise ConfigError(f"{where}: expected at most {MAX_SECONDS:.0f} seconds (30 days), got {raw!r}") from None
        raise ConfigError(f"{where}: expected a number of seconds above 0, got {raw!r}") from None


_MODELS_KEYS = {"default", "models"}
_AGENT_KEYS = {"name": str, "system_prompt": str, "max_iters": int, "inject_runtime_state": bool, "timezone": str}
_MW_KEYS = {"name", "address", "fail_open", "timeout", "max_items", "max_bytes", "max_item_bytes", "key", "permissions"}
_PERMISSION_KEYS = {"hooks": list, "context": bool, "mutate_context": bool, "set_model": bool, "tools": bool}
_SECURITY_KEYS = {
    "tls",
    "users",
    "middleware_tls",
    "middleware_token_env",
    "middleware_token_file",
    "attach_allow",
    "attach_permissions",
    "reflection",
}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_LIMIT_KEYS = ("max_message_bytes", "sessions_per_owner", "replies_per_owner")


def _beside(base: Path, value: str) -> str:
    """A file path the YAML file names, as users expect of a file that names files (docker compose,
    nginx): a relative one is relative to the file's directory, not to the host's working
    directory. Paths from flags and variables stay relative to the working directory."""
    if not value:
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base / path)


def _store_beside(base: Path, db: str) -> str:
    """``db`` / ``store.dsn`` as the YAML file gives it: a SQLite path beside the file; ":memory:"
    and DSNs (postgresql://, or another scheme open_store refuses by name) as they are."""
    return db if db == ":memory:" or "://" in db else _beside(base, db)


def _apply_yaml(cfg: HostConfig, path: Path) -> None:
    src = str(path)
    base = Path(os.path.abspath(path.expanduser())).parent  # where its relative paths start (_beside)
    data = read_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{src}: the top level must be a mapping of settings, not {_kind(data)}")
    cfg.source = src
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{src}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_TOP_KEYS))})")
    for key in ("listen", "db", "log_level", "loop"):
        if key in data:
            setattr(cfg, key, _expect(data[key], str, f"{src}: {key}"))
            cfg.origins[key] = f"{src}: {key}"
    if "db" in data:
        cfg.db = _store_beside(base, cfg.db)
    if data.get("metrics_port") is not None:
        cfg.metrics_port = _port(
            str(_expect(data["metrics_port"], int, f"{src}: metrics_port")), f"{src}: metrics_port"
        )
    store = data.get("store") or {}
    if not isinstance(store, Mapping):
        raise ConfigError(f"{src}: store: expected a mapping, got {_kind(store)}")
    for key, value in store.items():
        if key == "dsn":
            cfg.db = _store_beside(base, _expect(value, str, f"{src}: store.dsn"))
        elif key == "lease":
            cfg.lease = _seconds(value, f"{src}: store.lease")
        else:
            raise ConfigError(f"{src}: store: unknown key {key!r} (known: dsn, lease)")
    if "drain_grace" in data:
        cfg.drain_grace = _seconds(data["drain_grace"], f"{src}: drain_grace")
    agent = data.get("agent") or {}
    if not isinstance(agent, Mapping):
        raise ConfigError(f"{src}: agent: expected a mapping, got {_kind(agent)}")
    for key, value in agent.items():
        if key not in _AGENT_KEYS:
            raise ConfigError(f"{src}: agent: unknown key {key!r} (known: {', '.join(_AGENT_KEYS)})")
        value = _expect(value, _AGENT_KEYS[key], f"{src}: agent.{key}")
        if key == "max_iters":
            try:
                checked_max_iters(value)  # the rule of agent.max_iters = ... (0: the final answer at once)
            except ValueError as exc:
                raise ConfigError(f"{src}: agent.max_iters: {exc}") from None
        setattr(cfg, "agent_name" if key == "name" else key, value)
    if "timezone" in agent:
        from .runtime_state import resolve_timezone

        try:
            resolve_timezone(cfg.timezone)
        except ValueError as exc:
            raise ConfigError(f"{src}: agent.timezone: {exc}") from None
    if "models" in data:
        if not isinstance(data["models"], Mapping):
            raise ConfigError(f"{src}: models: expected a mapping, got {_kind(data['models'])}")
        unknown = sorted(set(data["models"]) - _MODELS_KEYS, key=str)
        if unknown:
            raise ConfigError(f"{src}: models: unknown key {unknown[0]!r} (known: {', '.join(sorted(_MODELS_KEYS))})")
        cfg.models = copy.deepcopy(dict(data["models"]))
        models = cfg.models.get("models")
        for spec in models.values() if isinstance(models, Mapping) else ():
            if isinstance(spec, dict) and isinstance(spec.get("api_key_file"), str):
                spec["api_key_file"] = _beside(base, spec["api_key_file"])
    if "tools" in data:
        from .service.builtin_tools import BUILTIN_TOOLS

        tools = data["tools"] or []
        if not isinstance(tools, Sequence) or isinstance(tools, str):
            raise ConfigError(f"{src}: tools: expected a list of tool names, got {_kind(tools)}")
        for i, name in enumerate(tools):
            name = _expect(name, str, f"{src}: tools[{i}]")
            if name not in BUILTIN_TOOLS:
                known = ", ".join(BUILTIN_TOOLS)
                raise ConfigError(f"{src}: tools[{i}]: unknown built-in tool {name!r} (known: {known})")
            if name in tools[:i]:
                raise ConfigError(f"{src}: tools[{i}]: {name!r} is listed twice")
        cfg.tools = list(tools)
    cfg.middleware = _yaml_middleware(data.get("middleware"), src)
    if data.get("tracing") is not None:
        if not isinstance(data["tracing"], Mapping):
            raise ConfigError(f"{src}: tracing: expected a mapping, got {_kind(data['tracing'])}")
        cfg.tracing = {k: _expect(v, str, f"{src}: tracing.{k}") for k, v in data["tracing"].items()}
    try:
        security = _mapping(data.get("security"), f"{src}: security", _SECURITY_KEYS)
        _yaml_security(cfg.security, security, src, base)
        for key in _TLS_SETTINGS:
            group, name = key.split(".")
            if name in (security.get(group) or {}):
                cfg.origins[key] = f"{src}: security.{key}"
    except SecurityError as exc:
        raise ConfigError(str(exc)) from None
    for key, value in _mapping(data.get("limits"), f"{src}: limits", set(_LIMIT_KEYS)).items():
        limit = _expect(value, int, f"{src}: limits.{key}")
        if limit < 1:
            raise ConfigError(f"{src}: limits.{key}: must be above 0, got {limit}")
        if key == "max_message_bytes" and limit > MAX_MESSAGE_BYTES:
            raise ConfigError(f"{src}: limits.{key}: must be at most {MAX_MESSAGE_BYTES} (gRPC's limit), got {limit}")
        setattr(cfg.security, key, limit)


def _mapping(raw: Any, where: str, known: set[str]) -> Mapping[str, Any]:
    """An optional mapping with only ``known`` keys ({} when absent)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {_kind(raw)}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return raw


def _yaml_security(sec: SecurityConfig, data: Mapping[str, Any], src: str, base: Path) -> None:
    """The ``security:`` section; its file paths relative to ``base``, the YAML file's directory."""
    where = f"{src}: security"
    tls = _mapping(data.get("tls"), f"{where}.tls", {"cert", "key", "client_ca", "require_client_cert"})
    sec.tls = TlsFiles(
        **{
            ("ca" if k == "client_ca" else k): _beside(base, _expect(v, str, f"{where}.tls.{k}"))
            for k, v in tls.items()
            if k != "require_client_cert"
        }
    )
    sec.require_client_cert = _expect(tls.get("require_client_cert", True), bool, f"{where}.tls.require_client_cert")
    mtls = _mapping(data.get("middleware_tls"), f"{where}.middleware_tls", {"ca", "cert", "key", "server_name"})
    given = {k: _expect(v, str, f"{where}.middleware_tls.{k}") for k, v in mtls.items()}
    sec.middleware_tls = TlsFiles(**{k: v if k == "server_name" else _beside(base, v) for k, v in given.items()})
    sec.middleware_token = read_secret(
        env=_expect(data.get("middleware_token_env", ""), str, f"{where}.middleware_token_env"),
        file=_beside(base, _expect(data.get("middleware_token_file", ""), str, f"{where}.middleware_token_file")),
        where=f"{where}.middleware_token",
    )
    users = data.get("users") or []
    if not isinstance(users, Sequence) or isinstance(users, str):
        raise ConfigError(f"{where}.users: expected a list, got {_kind(users)}")
    user_keys = {"name", "role", "token_env", "token_file", "token_sha256", "cert_cn"}
    for i, entry in enumerate(users):
        at = f"{where}.users[{i}]"
        entry = _mapping(entry, at, user_keys)
        name = _expect(entry.get("name", ""), str, f"{at}.name")
        role = _expect(entry.get("role", ""), str, f"{at}.role")
        if not name or role not in ROLES:
            raise ConfigError(f"{at}: needs a name and a role ({' or '.join(ROLES)})")
        digest = _expect(entry.get("token_sha256", ""), str, f"{at}.token_sha256").lower()
        if digest and not _SHA256_HEX.fullmatch(digest):  # not echoed: it may be a token pasted there
            got = "characters other than hex digits" if len(digest) == 64 else f"{len(digest)} characters"
            raise ConfigError(f"{at}.token_sha256: expected the token's SHA-256 as 64 hex digits, got {got}")
        secret = read_secret(
            env=_expect(entry.get("token_env", ""), str, f"{at}.token_env"),
            file=_beside(base, _expect(entry.get("token_file", ""), str, f"{at}.token_file")),
            where=f"{at}.token",
        )
        digest = token_digest(secret) if secret else digest  # only the digest is kept
        cert_cn = _expect(entry.get("cert_cn", ""), str, f"{at}.cert_cn")
        if not digest and not cert_cn:
            raise ConfigError(f"{at}: give a token (token_env, token_file or token_sha256) or a cert_cn")
        for other in sec.users:  # a token or a certificate names one user: else the first would win
            if other.name == name:
                raise ConfigError(f"{at}.name: {name!r} is used twice")
            if digest and other.token_sha256 == digest:
                raise ConfigError(f"{at}: {name!r} has the same token as {other.name!r} (each user needs their own)")
            if cert_cn and other.cert_cn == cert_cn:
                raise ConfigError(f"{at}.cert_cn: {cert_cn!r} is {other.name!r}'s already (each user needs their own)")
        sec.users.append(User(name, role, digest, cert_cn))
    if "attach_allow" in data:
        allow = data["attach_allow"] or []
        if not isinstance(allow, Sequence) or isinstance(allow, str):
            raise ConfigError(f"{where}.attach_allow: expected a list of HOST:PORT patterns, got {_kind(allow)}")
        sec.attach_allow = [_expect(a, str, f"{where}.attach_allow[{i}]") for i, a in enumerate(allow)]
    if "attach_permissions" in data:
        sec.attach_permissions = _permissions(data["attach_permissions"], f"{where}.attach_permissions")
    sec.reflection = _expect(data.get("reflection", False), bool, f"{where}.reflection")


def _permissions(raw: Any, where: str) -> Permissions:
    from agentmw.hooks import HOOKS

    entry = _mapping(raw, where, set(_PERMISSION_KEYS))
    values = {k: _expect(v, _PERMISSION_KEYS[k], f"{where}.{k}") for k, v in entry.items()}
    if "hooks" in values:
        for i, hook in enumerate(values["hooks"]):
            _expect(hook, str, f"{where}.hooks[{i}]")
        unknown = [h for h in values["hooks"] if h not in HOOKS]
        if unknown:
            raise ConfigError(f"{where}.hooks: unknown hook {unknown[0]!r} (known: {', '.join(HOOKS)})")
        values["hooks"] = frozenset(values["hooks"])
    return Permissions(**values)


def _unique_name(earlier: list[MiddlewareConfig], name: str, where: str) -> None:
    """A middleware entry's name (in either form) is not one an earlier entry has."""
    if name and any(m.name == name for m in earlier):
        raise ConfigError(f"{where}.name: {name!r} is used twice")


def _yaml_middleware(raw: Any, src: str) -> list[MiddlewareConfig]:
    if raw is None:
        return []
    if isinstance(raw, Mapping) and set(raw) & _MW_KEYS:  # one middleware's settings, its "- " forgotten
        raise ConfigError(
            f"{src}: middleware: expected a list, got one mapping (write each middleware as a list "
            f"item: '- {{name: ..., address: HOST:PORT}}')"
        )
    if isinstance(raw, Mapping):  # also accepted: {name: {address: ..., ...}} or {name: HOST:PORT}
        raw = [{"name": k, **(v if isinstance(v, Mapping) else {"address": v})} for k, v in raw.items()]
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise ConfigError(f"{src}: middleware: expected a list, got {_kind(raw)}")
    out: list[MiddlewareConfig] = []
    for i, entry in enumerate(raw):
        where = f"{src}: middleware[{i}]"
        if isinstance(entry, str):
            parsed = parse_middleware_arg(entry, where)
            _unique_name(out, parsed.name, where)
            out.append(parsed)
            continue
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: expected a mapping or NAME=HOST:PORT, got {_kind(entry)}")
        unknown = sorted(set(entry) - _MW_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_MW_KEYS))})")
        address = _expect(entry.get("address", ""), str, f"{where}.address")
        if address:
            check_middleware_address(address, f"{where}.address")
        # YAML has .nan and .inf
        timeout = _seconds(
            _expect(entry.get("timeout", DEFAULT_TIMEOUT), float, f"{where}.timeout"), f"{where}.timeout"
        )
        limits = {}
        for key in ("max_items", "max_bytes", "max_item_bytes"):
            if key in entry:
                limits[key] = _expect(entry[key], int, f"{where}.{key}")
                if limits[key] < 1:
                    raise ConfigError(f"{where}.{key}: must be above 0, got {limits[key]}")
        name = _expect(entry.get("name", ""), str, f"{where}.name")
        try:
            check_middleware_name(name)
        except ValueError as exc:
            raise ConfigError(f"{where}.name: {exc}") from None
        key = _expect(entry.get("key", ""), str, f"{where}.key")
        if key and any(m.key == key for m in out):
            raise ConfigError(f"{where}.key: {key!r} is used twice (one key = one middle_context slot)")
        if "permissions" in entry:
            limits["permissions"] = _permissions(entry["permissions"], f"{where}.permissions")
        _unique_name(out, name, where)
        out.append(
            MiddlewareConfig(
                address=address,
                name=name,
                fail_open=_expect(entry.get("fail_open", False), bool, f"{where}.fail_open"),
                timeout=float(timeout),
                key=key,
                source=where,
                **limits,
            )
        )
    return out


def _expect(value: Any, kind: type, where: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{where}: expected {kind.__name__}, got {_kind(value)} {value!r}")


def _kind(value: Any) -> str:
    kinds: dict[type, str] = {dict: "a mapping", list: "a list", str: "a string"}
    return kinds.get(type(value), type(value).__name__)


__all__ = [
    "ConfigError",
    "HostConfig",
    "MiddlewareConfig",
    "Permissions",
    "SecurityConfig",
    "check_middleware_address",
    "load_config",
    "parse_middleware_arg",
]
