"""Constrained decoding: outputs that match a JSON Schema or a forced tool call (llguidance)."""
