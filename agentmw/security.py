"""Transport security, shared by the host, its clients and the middleware SDK (see docs/security.md).

* TLS: gRPC's own credentials from PEM files (``TlsFiles``); a server given a certificate has a
  TLS port only, so plaintext clients are refused at the handshake. With a CA, the server checks
  client certificates (mutual TLS).
* Bearer tokens: sent as ``authorization: Bearer <token>`` metadata; the receiving side keeps
  only SHA-256 digests (``token_digest``) and compares in constant time. Tokens are never logged.

Who a host call is from and the attach allow-list are the host's (agent_host.security).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import ssl
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc

from .transport import MAX_MESSAGE

AUTH_HEADER = "authorization"


class SecurityError(ValueError):
    """A security setting that cannot work (a missing file, a key without a certificate)."""


def token_digest(token: str) -> str:
    """The hex SHA-256 of a token: what configurations and servers keep instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


async def abort(context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    """``context.abort(code, details)`` of a gRPC servicer, which always raises: typed so, as grpc has
    no type stubs here, so that code after it is known not to run."""
    await context.abort(code, details)
    raise AssertionError("ServicerContext.abort returned")


REFUSE_WAIT = 5.0  # seconds a refused streaming call is given to send its first request


async def refuse_stream(requests: Any, context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    """``abort`` for a call whose client streams its requests: once its first request has come (or
    REFUSE_WAIT has passed). Refused before, a client still writing that request was told grpc-python
    aio's own INTERNAL "Internal error from Core" in place of the status now and then: its failed
    write overwrites the status it had (grpc/grpc#36066)."""
    with contextlib.suppress(Exception):  # no request in time, or a client gone: refuse all the same
        async with asyncio.timeout(REFUSE_WAIT):
            await anext(aiter(requests), None)
    await abort(context, code, details)


def presented_token(metadata: Iterable[Any] | None) -> str:
    """The bearer token of a call's invocation metadata ("" when there is none)."""
    for key, value in metadata or ():
        if key == AUTH_HEADER and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return ""


def token_matches(token: str, digests: Iterable[str]) -> bool:
    """Constant-time comparison of a presented token with the accepted digests."""
    if not token:
        return False
    presented = token_digest(token)
    return any(hmac.compare_digest(presented, d) for d in digests)


def read_secret(*, env: str = "", file: str = "", environ: Mapping[str, str] | None = None, where: str = "") -> str:
    """A secret named by an environment variable or a file (never the value itself in a config)."""
    environ = os.environ if environ is None else environ
    if env:
        value = environ.get(env, "").strip()
        if not value:
            raise SecurityError(f"{where}: the environment variable {env} is not set")
        return value
    if file:
        try:
            value = Path(file).expanduser().read_text().strip()
        except OSError as exc:
            raise SecurityError(f"{where}: cannot read {file} ({exc.strerror or exc})") from None
        if not value:
            raise SecurityError(f"{where}: {file} is empty")
        return value
    return ""


@dataclass
class TlsFiles:
    """PEM file paths. Server side: ``cert``/``key`` are its own, ``ca`` verifies client
    certificates. Client side: ``ca`` verifies the server, ``cert``/``key`` are the client's (mTLS).
    ``server_name``: the name the server's certificate must carry when it is not the address's host."""

    cert: str = ""
    key: str = ""
    ca: str = ""
    server_name: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def _read(self, which: str, where: str) -> bytes | None:
        path = getattr(self, which)
        if not path:
            return None
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as exc:
            raise SecurityError(f"{where}: cannot read the TLS {which} {path} ({exc.strerror or exc})") from None

    def check(self, where: str) -> None:
        """The files are there and load as PEM, the key matching the certificate: gRPC only fails
        later, saying no more than that a port could not be bound or a handshake failed."""
        if bool(self.cert) != bool(self.key):
            raise SecurityError(f"{where}: a TLS certificate needs its key and a key its certificate")
        for which in ("cert", "key", "ca"):
            self._read(which, where)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:  # password b"": an encrypted key fails here (gRPC cannot take a passphrase) instead of a prompt
            if self.cert:
                what = f"the TLS cert {self.cert} with its key {self.key}"
                context.load_cert_chain(Path(self.cert).expanduser(), Path(self.key).expanduser(), password=b"")
            if self.ca:
                what = f"the TLS CA {self.ca}"
                context.load_verify_locations(cafile=Path(self.ca).expanduser())
        except ssl.SSLError as exc:
            why = exc.reason if exc.reason and exc.reason != "PEM lib" else "not PEM"
            raise SecurityError(f"{where}: {what} cannot be used ({why})") from None

    def server_credentials(self, *, require_client_cert: bool = True, where: str = "tls") -> grpc.ServerCredentials:
        """A TLS server; with ``ca``, client certificates signed by it are required (mutual TLS)
        unless ``require_client_cert`` is False (then they are verified when presented)."""
        self.check(where)
        if not self.cert:
            raise SecurityError(f"{where}: a TLS server needs a certificate and its key")
        cert, key, ca = self._read("cert", where), self._read("key", where), self._read("ca", where)
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=bool(ca) and require_client_cert
        )

    def channel_credentials(self, where: str = "tls") -> grpc.ChannelCredentials:
        self.check(where)
        return grpc.ssl_channel_credentials(
            root_certificates=self._read("ca", where),
            private_key=self._read("key", where),
            certificate_chain=self._read("cert", where),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel(
    address: str,
    tls: TlsFiles | None = None,
    *,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] | None = None,
) -> grpc.aio.Channel:
    """A TLS channel when ``tls`` is enabled, else plaintext."""
    if tls is not None and tls.enabled:
        opts = [*options, *tls.channel_options()]
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


# Why OpenSSL did not verify a certificate, besides an unknown CA (X509_verify_cert_error_string).
_VERIFY_REASONS = ("has expired", "is not yet valid", "has been revoked")


def tls_hint(details: str | None, tls: bool, *, use_tls: str, client_cert: str) -> str:
    """What a failed connection's error text may owe to TLS, as a clause ("" when nothing points
    there); ``tls``: whether the channel used TLS; ``use_tls`` / ``client_cert``: where the caller
    sets TLS up and its client certificate. gRPC says only "Socket closed" when a TLS server closes
    a plaintext connection, or a server with mutual TLS one without a certificate it trusts (as for
    a server that closed for any other reason); a TLS client's handshake fails against a plaintext
    server or an untrusted certificate."""
    text = details or ""
    if "handshake failed" in text.lower():
        if "WRONG_VERSION_NUMBER" in text:
            return "the TLS handshake failed: the server may not use TLS"
        if "CERTIFICATE_VERIFY_FAILED" in text:
            for reason in _VERIFY_REASONS:  # OpenSSL's own words follow the code
                if reason in text:
                    return f"the TLS handshake failed: the server's certificate {reason}"
            return "the TLS handshake failed: the server's certificate is not signed by the CA trusted here"
        return "the TLS handshake failed"
    # "Stream removed": the call had its stream on a connection that had come up (the server sent
    # its HTTP/2 settings), which a TLS mismatch never does; then the connection went (a server
    # killed before the client read any of its answer).
    if "Socket closed" not in text or "Stream removed" in text:
        return ""
    if tls:
        return f"TLS may be the cause: does the server require a client certificate it trusts ({client_cert})?"
    return f"TLS may be the cause: does the server require TLS ({use_tls})?"


# ---------------------------------------------------------------------------------------------
# Client side: a token on every call of a channel (agent-chat and other host clients).


class _BearerDetails(grpc.aio.ClientCallDetails):
    pass


class _Bearer:
    """Adds ``authorization: Bearer <token>`` to each call it intercepts."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(token)

    async def _intercept(self, continuation: Any, d: grpc.aio.ClientCallDetails, request: Any) -> Any:
        metadata = grpc.aio.Metadata(*(d.metadata or ()), *self._metadata)
        return await continuation(
            _BearerDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready), request
        )


# One class per call kind: a channel files each interceptor under the first kind it is an instance of.
class _BearerUnaryUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _Bearer._intercept


class _BearerUnaryStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _Bearer._intercept


class _BearerStreamUnary(_Bearer, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _Bearer._intercept


class _BearerStreamStream(_Bearer, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _Bearer._intercept


def bearer_interceptors(token: str) -> list[Any]:
    """Interceptors that put the token on every call of a channel (each kind of call)."""
    kinds = (_BearerUnaryUnary, _BearerUnaryStream, _BearerStreamUnary, _BearerStreamStream)
    return [kind(token) for kind in kinds]


# What a client of the host accepts in one message: a ReplyEvent's single item may be as large as a
# tool result the host made, and GetSession carries a whole session (host.proto ReplyEvent).
CLIENT_MAX_MESSAGE = MAX_MESSAGE


def client_channel(address: str, tls: TlsFiles | None = None, token: str = "") -> grpc.aio.Channel:
    """A channel to an AgentHost: TLS when configured, the token on every call when given."""
    options = [("grpc.max_receive_message_length", CLIENT_MAX_MESSAGE)]
    return channel(address, tls, options=options, interceptors=bearer_interceptors(token) if token else None)


__all__ = [
    "AUTH_HEADER",
    "SecurityError",
    "TlsFiles",
    "abort",
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
