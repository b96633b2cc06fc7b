"""Diagnostics: learner/rollout gap metrics, the divergence tracer, reports, CLI and training monitor."""
