"""Scorers: one per module, each with its ``factory`` beside it, listed in `routing.wiring`."""
