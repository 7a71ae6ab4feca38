"""Local runs, sweeps and cluster launchers (installed as rlvr.launch)."""
