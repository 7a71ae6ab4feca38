"""Rewards: verifiers and learned reward models."""
