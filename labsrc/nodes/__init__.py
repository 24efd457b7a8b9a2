"""Emulated machines on one computer: nodes with their own network stacks and shaped links, a Slurm cluster."""
