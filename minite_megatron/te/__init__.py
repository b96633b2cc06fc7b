"""Transformer Engine path: miniTE quantizers behind TE's CustomRecipe (TE >= 2.16)."""
