"""Training state, the step, checkpoints."""
