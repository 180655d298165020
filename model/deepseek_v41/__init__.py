"""DeepSeek-V4.1 text model: config, layers, checkpoint format, loader and random init (spec:
shared/reference/model-v41-spec.md)."""
