"""agentmw: the core that the agent host and every middleware server share (docs/packaging.md).

The data model (``agentmw.data``) and its protobuf codec, the hook table and wire helpers,
``MiddlewareBase``, subscriptions, tools, transport security, the error types that cross the wire,
the generated gRPC stubs (``agentmw.v1``, made by `make protos` and by the package build) and the
middleware SDK (``agentmw.sdk``). Installed alone as the ``agentmw-sdk`` distribution: nothing here
imports the host (``agent_host``).
"""
