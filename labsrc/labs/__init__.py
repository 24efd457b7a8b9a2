"""torchrun entry points, one per lab: `torchrun -m labsrc.labs.<name>` (thin: parse, set up, call, tear down)."""
