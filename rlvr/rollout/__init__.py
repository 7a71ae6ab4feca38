"""Rollout: the embedded JAX engine, its SGLang-compatible server, and the SGLang client."""
