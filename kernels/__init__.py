"""Pallas attention kernels (installed as rlvr.kernels)."""
