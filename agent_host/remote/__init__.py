"""The host's client for middleware servers: attach by address, one generic protocol driver."""

from .client import MiddlewareFailure, Policy, ProtocolError, RemoteMiddleware, RemoteMiddlewareError, RemoteTool

__all__ = ["MiddlewareFailure", "Policy", "ProtocolError", "RemoteMiddleware", "RemoteMiddlewareError", "RemoteTool"]
