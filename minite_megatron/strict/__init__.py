"""Batch-invariant (strict-mode) ops: results per row independent of batch size and of prefill vs decode."""
