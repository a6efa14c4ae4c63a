"""Generated gRPC stubs live in agentmw.v1 (made by `make protos` and by the package build)."""
