"""Checkers for the exercises at the end of each notebook, one module per lesson (see labsrc.core.exercises)."""
