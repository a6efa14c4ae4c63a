"""The host as a service: sessions, attached middleware, and the AgentHost gRPC server."""

from .host import Attached, Host, ReplyRejected, ReplyRun
from .server import AgentHostServicer, StartupError, build_host, run_host, start_server

__all__ = [
    "AgentHostServicer",
    "Attached",
    "Host",
    "ReplyRejected",
    "ReplyRun",
    "StartupError",
    "build_host",
    "run_host",
    "start_server",
]
