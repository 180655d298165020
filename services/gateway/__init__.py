"""The gateway: OpenAI-compatible HTTP and the public gRPC API (shinkai.v1) over engine replicas."""
