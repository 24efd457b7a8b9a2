"""Planted-bug scripts of notebook 12, each run by path with launch.run."""
