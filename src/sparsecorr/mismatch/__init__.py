"""MEASURE: per-token mismatch between the sparse sampler and the dense model."""

__all__: list[str] = []
