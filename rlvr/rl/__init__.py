"""RL maths for GRPO/PPO-family post-training: advantages, policy losses, filters (pure jnp)."""
