"""Isolated code execution (installed as rlvr.sandbox)."""
