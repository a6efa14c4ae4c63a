"""Caller identity and the attach allow-list: the host's side of security (docs/security.md).

* ``Principal``: who a host call is from (a configured user, by token or client certificate).
* ``address_allowed``: the attach allow-list (default: loopback only, plus configured addresses).

Transport security (TLS files, bearer tokens, channels) is shared with the middleware SDK and lives
in agentmw.security; it is re-exported here for the host's modules.
"""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentmw.security import (
    AUTH_HEADER,
    SecurityError,
    TlsFiles,
    abort,
    bearer_interceptors,
    bearer_metadata,
    channel,
    client_channel,
    presented_token,
    read_secret,
    refuse_stream,
    tls_hint,
    token_digest,
    token_matches,
)

ADMIN, USER = "admin", "user"
ROLES = (USER, ADMIN)


# ---------------------------------------------------------------------------------------------
# Server side: who is calling.


@dataclass(frozen=True)
class Principal:
    """The caller of a host RPC. ``name`` owns the sessions it creates ("" without authentication)."""

    name: str
    role: str

    @property
    def admin(self) -> bool:
        return self.role == ADMIN


ANONYMOUS_ADMIN = Principal("", ADMIN)  # no authentication configured: everything, as on loopback


@dataclass(frozen=True)
class User:
    """A configured identity: by token (its SHA-256) and/or by the common name of a client certificate."""

    name: str
    role: str
    token_sha256: str = ""
    cert_cn: str = ""


class Authenticator:
    """Maps a call's token or client certificate to a configured user; no users = no authentication."""

    def __init__(self, users: Sequence[User]) -> None:
        self.users = list(users)

    @property
    def enabled(self) -> bool:
        return bool(self.users)

    def authenticate(self, metadata: Iterable[Any] | None, auth_context: Mapping[str, Any] | None) -> Principal | None:
        if not self.enabled:
            return ANONYMOUS_ADMIN
        token = presented_token(metadata)
        if token:  # a token that matches no one is refused, even with a valid certificate
            presented = token_digest(token)
            user = next(
                (u for u in self.users if u.token_sha256 and hmac.compare_digest(presented, u.token_sha256)), None
            )
            return Principal(user.name, user.role) if user else None
        common_names = (auth_context or {}).get("x509_common_name", ())
        names = {v.decode() if isinstance(v, bytes) else str(v) for v in common_names}
        user = next((u for u in self.users if u.cert_cn and u.cert_cn in names), None)
        return Principal(user.name, user.role) if user else None


# ---------------------------------------------------------------------------------------------
# Attach allow-list.


def _hosts(address: str) -> list[tuple[str, str]]:
    """(host, port) pairs of a gRPC target: host:port, ipv4:a:p,b:p, ipv6:[..]:p, dns:///host:port."""
    target = address
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix) :]
            break
    if target.startswith("//") or "://" in target or target.startswith("unix:"):
        return []  # dns://resolver/..., unix:: never loopback by our rules, only listed exactly
    out = []
    for part in target.split(","):
        host, _, port = part.strip().rpartition(":")
        out.append((host.strip("[]").lower(), port))
    return out


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_allowed(address: str, allow: Sequence[str] | None, configured: Iterable[str] = ()) -> bool:
    """Whether AttachMiddleware may connect to ``address``: it is one of the ``configured``
    middleware addresses, or each of its addresses matches an ``allow`` pattern ("10.0.0.*:50061",
    see _pair_matches); ``allow`` None (the default) admits loopback addresses only."""
    if address in set(configured):
        return True
    hosts = _hosts(address)
    if allow is None:
        return bool(hosts) and all(is_loopback(h) for h, _ in hosts)
    if not hosts:  # unix:, dns://authority/...: only a pattern naming it exactly
        return address in allow
    return all(any(_pair_matches(host, port, pattern) for pattern in allow) for host, port in hosts)


def _pair_matches(host: str, port: str, pattern: str) -> bool:
    """``host:port`` against ``pattern``: ``*`` and ``?`` stand within one label of the host
    (between dots or colons) and within the port, so "10.0.0.*:50061" admits 10.0.0.7 and not a
    name such as 10.0.0.1.example.org (which fnmatch on the whole text admitted)."""
    want_host, _, want_port = pattern.rpartition(":")
    if not fnmatch.fnmatchcase(port, want_port):
        return False
    got, want = _LABELS.split(host), _LABELS.split(want_host.strip("[]").lower())
    return len(got) == len(want) and all(
        g == w if i % 2 else fnmatch.fnmatchcase(g, w) for i, (g, w) in enumerate(zip(got, want, strict=True))
    )


_LABELS = re.compile(r"([.:])")  # a host's labels, with the separators kept (odd indexes)


__all__ = [
    "ADMIN",
    "ANONYMOUS_ADMIN",
    "AUTH_HEADER",
    "ROLES",
    "USER",
    "Authenticator",
    "Principal",
    "SecurityError",
    "TlsFiles",
    "User",
    "abort",
    "address_allowed",
    "bearer_interceptors",
    "bearer_metadata",
    "channel",
    "client_channel",
    "presented_token",
    "read_secret",
    "refuse_stream",
    "tls_hint",
    "token_digest",
    "token_matches",
]
