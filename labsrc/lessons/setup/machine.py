"""What this machine will run: the three profiles side by side, as a table that fits a notebook's width."""
from __future__ import annotations

from labsrc.core.profiles import PROFILES, Profile

MODELS = {"tiny_cnn": "small CNN", "resnet18": "ResNet-18"}  # the profiles' model names, as a reader says them

ROWS = {  # the row's label: how a profile's value reads in it (the sizes notebook 00 explains; the rest come later)
    "ranks": lambda p: str(p.world_size) if p.world_size else "1 per GPU (2 on one)",
    "model": lambda p: MODELS.get(p.model, p.model),
    "training samples": lambda p: f"{p.num_samples:,}",
    "global batch": lambda p: str(p.global_batch),
    "training steps": lambda p: str(p.steps),
    "time budget per notebook": lambda p: _duration(p.notebook_budget_s),
}


def _duration(seconds: int) -> str:
    """90 -> '90 s', 600 -> '10 min': a notebook's time budget, short."""
    return f"{seconds // 60} min" if seconds >= 120 and seconds % 60 == 0 else f"{seconds} s"


def profile_table(profiles: dict[str, Profile] = PROFILES, current: str | None = None) -> str:
    """One row per setting, one column per profile, every column as wide as its widest cell; `current` marked."""
    names = [f"{name} (now)" if name == current else name for name in profiles]
    cells = [[label] + [read(p) for p in profiles.values()] for label, read in ROWS.items()]
    widths = [max(len(row[i]) for row in cells + [["", *names]]) for i in range(len(names) + 1)]
    lines = [" " * widths[0] + "".join(f"  {name:>{w}}" for name, w in zip(names, widths[1:]))]
    lines += [row[0].ljust(widths[0]) + "".join(f"  {cell:>{w}}" for cell, w in zip(row[1:], widths[1:]))
              for row in cells]
    return "\n".join(lines)
