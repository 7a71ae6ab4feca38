"""rlvr: JAX-native LLM post-training."""

__version__ = "0.1.0"
