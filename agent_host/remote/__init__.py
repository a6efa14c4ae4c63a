"""The host's client for middleware servers: attach by address, one generic protocol driver."""

from .client import Policy, RemoteMiddleware, RemoteTool
from .errors import MiddlewareFailure, ProtocolError, RemoteMiddlewareError

__all__ = ["MiddlewareFailure", "Policy", "ProtocolError", "RemoteMiddleware", "RemoteMiddlewareError", "RemoteTool"]
