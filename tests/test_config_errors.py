"""Bad settings of the host (host.yaml, flags, variables) and of ``agentmw``: each is refused in one
line naming the setting and what is wrong (exit 2), never a traceback. In-process where the loader
or the parser shows it; one real host process for what used to fail only once the host started."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent_host.config import MAX_SECONDS, ConfigError, check_seconds, load_config
from agent_host.store.postgres import PostgresStore
from clients import admin

from .host_util import run_cli

pytestmark = pytest.mark.timeout(60)


def _load(tmp_path: Path, text: str) -> None:
    path = tmp_path / "host.yaml"
    path.write_text(text)
    load_config(path, env={}, flags={})


def _refused(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _load(tmp_path, text)
    assert str(raised.value) == f"{tmp_path / 'host.yaml'}: {error}"


def test_a_tool_listed_twice_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Was ``ValueError: tool 'add' is already registered``, a traceback from Host.__init__."""
    _refused(tmp_path, "tools: [add, get_weather, add]\n", "tools[2]: 'add' is listed twice")
    path = tmp_path / "host.yaml"
    done = run_cli("agent_host", "--config", str(path), "--db", ":memory:", "--listen", "127.0.0.1:0", timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"agent-host: configuration error: {path}: tools[2]: 'add' is listed twice"
    ], done.stderr


def test_a_tool_that_is_not_a_name_is_refused(tmp_path: Path) -> None:
    """``tools: [[add]]`` was a TypeError (unhashable list)."""
    _refused(tmp_path, "tools: [[add]]\n", "tools[0]: expected str, got a list ['add']")


def test_a_permitted_hook_that_is_not_a_name_is_refused(tmp_path: Path) -> None:
    """``permissions: {hooks: [[on_reply]]}`` was a TypeError (unhashable list) in _permissions."""
    _refused(
        tmp_path,
        "middleware:\n  - {name: a, address: 127.0.0.1:1, permissions: {hooks: [[on_reply]]}}\n",
        "middleware[0].permissions.hooks[0]: expected str, got a list ['on_reply']",
    )
    _refused(
        tmp_path,
        "security:\n  attach_permissions: {hooks: [on_reply, {a: 1}]}\n",
        "security.attach_permissions.hooks[1]: expected str, got a mapping {'a': 1}",
    )


@pytest.mark.parametrize("limit", [2**31, 99999999999999999999999])
def test_max_message_bytes_beyond_grpcs_int_is_refused(tmp_path: Path, limit: int) -> None:
    """Was an OverflowError from the gRPC server's options once the host started."""
    _refused(
        tmp_path,
        f"limits: {{max_message_bytes: {limit}}}\n",
        f"limits.max_message_bytes: must be at most 2147483647 (gRPC's limit), got {limit}",
    )
    _load(tmp_path, f"limits: {{max_message_bytes: {2**31 - 1}}}\n")  # the largest one is taken


def test_a_malformed_postgres_dsn_is_one_line_with_the_password_redacted() -> None:
    """A port that is not a number was asyncpg's ValueError, a traceback."""
    with pytest.raises(OSError) as raised:
        asyncio.run(PostgresStore.connect("postgresql://u:hunter2@127.0.0.1:notaport/db"))
    assert str(raised.value) == (
        "malformed DSN postgresql://u:***@127.0.0.1:notaport/db: invalid literal for int() with base 10: 'notaport'"
    )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--position", "99999999999"], "argument --position: must be 2147483647 or less, not 99999999999"),
        (["--position", "-1"], "argument --position: must be 0 or more, not -1"),
        (["--timeout", "1e10"], "argument --timeout: must be 2592000 seconds (30 days) or less, not 1e10"),
    ],
)
def test_admin_attach_numbers_out_of_range_are_usage_errors(
    args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--position beyond int32 was a protobuf ValueError traceback; -1 went to the host; a --timeout
    of 1e10 s overflowed every gRPC deadline (the host then refused it, or every call failed)."""
    with pytest.raises(SystemExit) as raised:
        admin.parse_args(["--host", "127.0.0.1:1", "middleware", "attach", "127.0.0.1:2", "--name", "x", *args])
    assert raised.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"agentmw middleware attach: error: {error}"
    ok = admin.parse_args(["middleware", "attach", "127.0.0.1:2", "--position", str(admin.INT32_MAX)])
    assert ok.position == admin.INT32_MAX


def test_admin_alive_timeout_beyond_the_maximum_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        admin.parse_args(["alive", "--timeout", "1e10"])
    assert raised.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "agentmw alive: error: argument --timeout: must be 2592000 seconds (30 days) or less, not 1e10"
    )
    assert admin.parse_args(["alive", "--timeout", str(MAX_SECONDS)]).timeout == MAX_SECONDS


def test_durations_beyond_30_days_are_refused(tmp_path: Path) -> None:
    """A timeout of ~1e10 s passed check_seconds, and every gRPC call with it failed at once."""
    with pytest.raises(ValueError, match="at most 2592000 seconds"):
        check_seconds(1e10)
    assert check_seconds(MAX_SECONDS) == MAX_SECONDS
    _refused(
        tmp_path,
        "middleware:\n  - {name: a, address: 127.0.0.1:1, timeout: 1.0e+10}\n",
        "middleware[0].timeout: expected at most 2592000 seconds (30 days), got 10000000000.0",
    )
    _refused(tmp_path, "drain_grace: 1.0e+300\n", "drain_grace: expected at most 2592000 seconds (30 days), got 1e+300")
    with pytest.raises(ConfigError, match=r"^flag --lease: expected at most 2592000 seconds \(30 days\), got '1e10'$"):
        load_config(env={}, flags={"lease": "1e10"})
    with pytest.raises(ConfigError, match=r"^environment AGENTMW_DRAIN_GRACE: expected a number of seconds above 0"):
        load_config(env={"AGENTMW_DRAIN_GRACE": "-1"})


def test_a_middleware_name_used_twice_in_the_string_form_is_refused(tmp_path: Path) -> None:
    """The NAME=HOST:PORT form skipped the duplicate check of the mapping form."""
    _refused(
        tmp_path,
        'middleware: ["a=127.0.0.1:1", "a=127.0.0.1:2"]\n',
        "middleware[1].name: 'a' is used twice",
    )
    _refused(
        tmp_path,
        'middleware: [{name: a, address: "127.0.0.1:1"}, "a=127.0.0.1:2"]\n',
        "middleware[1].name: 'a' is used twice",
    )
    _load(tmp_path, 'middleware: ["127.0.0.1:1", "127.0.0.1:2", "a=127.0.0.1:3"]\n')  # unnamed: Describe's key


def test_a_middleware_name_given_twice_by_flags_or_the_environment_is_refused(tmp_path: Path) -> None:
    """Two --middleware flags of one name: the second quietly replaced the first."""
    with pytest.raises(ConfigError) as raised:
        load_config(env={}, flags={"middleware": ["a=127.0.0.1:1", "a=127.0.0.1:2"]})
    assert str(raised.value) == "flag --middleware 'a=127.0.0.1:2': the name 'a' is used twice"
    with pytest.raises(ConfigError, match=r"^environment AGENTMW_MIDDLEWARE 'a=127.0.0.1:2': the name 'a' is used"):
        load_config(env={"AGENTMW_MIDDLEWARE": "a=127.0.0.1:1,a=127.0.0.1:2"})
    # A flag still overlays the YAML's middleware of its name (docs/host.md).
    path = tmp_path / "host.yaml"
    path.write_text("middleware: [{name: a, address: '127.0.0.1:1', fail_open: true}]\n")
    cfg = load_config(path, env={"AGENTMW_MIDDLEWARE": "a=127.0.0.1:2"}, flags={"middleware": ["a=127.0.0.1:3"]})
    assert [(m.name, m.address, m.fail_open) for m in cfg.middleware] == [("a", "127.0.0.1:3", True)]


def test_an_unknown_key_in_models_is_refused(tmp_path: Path) -> None:
    """``defualt: b`` was ignored: the registry's default stayed the first model's."""
    _refused(
        tmp_path,
        "models:\n  defualt: b\n  models:\n    a: {provider: offline}\n    b: {provider: offline}\n",
        "models: unknown key 'defualt' (known: default, models)",
    )


@pytest.mark.parametrize(
    ("models", "error"),
    [
        ("default: 1\n  models:\n    a: {provider: offline}\n", "default: expected a model id (a string), got 1"),
        (
            "models:\n    1: {provider: offline}\n    b: {provider: offline}\n",
            "model id 1: expected a string (quote it in YAML)",
        ),
        (
            "models:\n    a: {provider: [offline]}\n",
            "model 'a': unknown provider ['offline'] (known: ['dashscope', 'offline', 'openai'])",
        ),
    ],
)
def test_a_model_id_or_provider_that_is_not_a_string_is_named(tmp_path: Path, models: str, error: str) -> None:
    """Were ``'<' not supported between instances of 'str' and 'int'`` and ``unhashable type: 'list'``."""
    path = tmp_path / "host.yaml"
    path.write_text(f"models:\n  {models}")
    with pytest.raises(ConfigError) as raised:
        load_config(path, env={}, flags={}).build_models()
    assert str(raised.value) == f"{path}: models: {error}"


@pytest.mark.parametrize("digest", ["not hex", "ab" * 31, "g" * 64, "a" * 65])
def test_a_token_sha256_must_be_64_hex_digits(tmp_path: Path, digest: str) -> None:
    """Was accepted: a user no token could ever match."""
    got = "characters other than hex digits" if len(digest) == 64 else f"{len(digest)} characters"
    _refused(
        tmp_path,
        f"security:\n  users:\n    - {{name: a, role: user, token_sha256: '{digest}'}}\n",
        f"security.users[0].token_sha256: expected the token's SHA-256 as 64 hex digits, got {got}",
    )
    _load(tmp_path, f"security:\n  users:\n    - {{name: a, role: user, token_sha256: '{'AB' * 32}'}}\n")
