"""Rollout engine on the same specs and kernels, returning per-token log-probs."""
