"""Figures of notebook 07 (model and tensor parallel): shard layout, the naive split's busy timeline, bytes, cost."""
from __future__ import annotations

from labsrc.core.figures import new_axes
from labsrc.lessons.model_tensor_parallel.lab import BlockCheck, BusyInterval, CostRow, ShardLayout

RANK_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray")


def shard_layout(result, block: str = "mlp"):
    """Each weight of the block as a (out, in) rectangle, cut into the parts ranks hold, coloured by rank."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    shards = [s for s in result.of(ShardLayout) if s.block == block]
    names = list(dict.fromkeys(s.parameter for s in shards))
    figure, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        pieces = [s for s in shards if s.parameter == name]
        rows, columns = pieces[0].dense_shape
        for piece in pieces:
            colour = RANK_COLOURS[piece.rank % len(RANK_COLOURS)]
            if piece.dim < 0:  # the shard is no contiguous block of the dense weight: nothing to draw
                ax.text(columns / 2, rows * (0.2 + 0.6 * piece.rank / len(pieces)),
                        f"rank {piece.rank}: not a block", ha="center", color=colour)
                continue
            if piece.dim == 0:  # a block of rows: output features
                box = Rectangle((0, rows - piece.stop), columns, piece.stop - piece.start, color=colour, alpha=0.6)
            else:  # a block of columns: input features
                box = Rectangle((piece.start, 0), piece.stop - piece.start, rows, color=colour, alpha=0.6)
            ax.add_patch(box)
            ax.text(box.get_x() + box.get_width() / 2, box.get_y() + box.get_height() / 2,
                    f"rank {piece.rank}\n{piece.shard_shape[0]}x{piece.shard_shape[1]}", ha="center", va="center")
        ax.set_xlim(0, columns)
        ax.set_ylim(0, rows)
        ax.set_title(f"{name}.weight {rows}x{columns}: {pieces[0].style}-parallel")
        ax.set_xlabel("in features")
        ax.set_ylabel("out features")
    figure.tight_layout()
    return figure


def busy_timeline(result):
    """The naive split: one row per rank, forward (solid) and backward (hatched) boxes, step numbers on them."""
    intervals = result.of(BusyInterval)
    origin = min(i.start for i in intervals)
    ax = new_axes("Naive model parallelism: when each rank computes",
                  "time (ms); solid: forward, hatched: backward, number: step", "rank", figsize=(8, 3))
    for interval in intervals:
        colour = RANK_COLOURS[interval.rank % len(RANK_COLOURS)]
        left, width = (interval.start - origin) * 1e3, (interval.end - interval.start) * 1e3
        ax.barh(interval.rank, width, left=left, color=colour, hatch="//" if interval.phase == "backward" else None,
                edgecolor="black", alpha=0.8)
        ax.text(left + width / 2, interval.rank, str(interval.step), ha="center", va="center", fontsize=8)
    ax.set_yticks(sorted({i.rank for i in intervals}))
    ax.invert_yaxis()
    ax.figure.tight_layout()
    return ax


def bytes_against_formula(result):
    """All-reduce payload each block handed to all_reduce, forward and backward, beside the formula's."""
    checks = result.of(BlockCheck, rank=0)
    ax = new_axes("All-reduce payload per step, counted vs formula", "", "bytes")
    labels, counted, formula = [], [], []
    for check in checks:
        for phase in ("forward", "backward"):
            labels.append(f"{check.block}\n{phase}")
            counted.append(getattr(check, f"{phase}_bytes"))
            formula.append(getattr(check, f"expected_{phase}_bytes"))
    positions = range(len(labels))
    ax.bar([p - 0.2 for p in positions], counted, width=0.4, label="counted in the autograd functions")
    ax.bar([p + 0.2 for p in positions], formula, width=0.4, label="batch x seq x hidden x 4 bytes")
    ax.set_xticks(list(positions), labels)
    ax.legend(loc="lower center")
    ax.figure.tight_layout()
    return ax


def cost_comparison(result):
    """Communication seconds per step against tokens per step: measured here, the fitted model, and NVLink."""
    rows = result.of(CostRow, rank=0)
    ax = new_axes("Tensor vs data parallel: communication per step", "tokens per step", "seconds")
    styles = {"tensor": "tab:red", "data": "tab:blue"}
    for scheme, colour in styles.items():
        mine = sorted((r for r in rows if r.scheme == scheme), key=lambda r: r.tokens)
        tokens = [r.tokens for r in mine]
        ax.plot(tokens, [r.measured_s for r in mine], "o-", color=colour, label=f"{scheme}: measured here")
        ax.plot(tokens, [r.predicted_s for r in mine], "x--", color=colour, label=f"{scheme}: alpha-beta fit")
        ax.plot(tokens, [r.nvlink_s for r in mine], ":", color=colour, label=f"{scheme}: model, NVLink (assumed)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.figure.tight_layout()
    return ax


def column_row_split(world_size: int = 2):
    """The Megatron MLP on world_size ranks as a diagram: f, the column-split fc1 (rows of weight), GELU on each
    rank's features, the row-split fc2 (columns of weight), g; what each of f and g does forward and backward."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch
    figure, ax = plt.subplots(figsize=(10, 1.4 + 1.3 * world_size))
    ax.set_axis_off()
    height = 1.3 * world_size

    def box(x, y, width, tall, text, colour="white"):
        ax.add_patch(FancyBboxPatch((x, y), width, tall, boxstyle="round,pad=0.02", facecolor=colour,
                                    edgecolor="black", alpha=0.8))
        ax.text(x + width / 2, y + tall / 2, text, ha="center", va="center", fontsize=9)

    box(0, height / 2 - 0.4, 1.1, 0.8, "X\n(tokens, h)\nwhole on\nevery rank")
    box(1.5, 0.1, 0.6, height - 0.2, "f", "gold")
    box(7.6, 0.1, 0.6, height - 0.2, "g", "gold")
    for rank in range(world_size):
        y = height - 1.3 * (rank + 1) + 0.25
        colour = RANK_COLOURS[rank % len(RANK_COLOURS)]
        box(2.5, y, 1.6, 0.8, f"rank {rank}: fc1 rows\n(4h/{world_size}, h)", colour)
        box(4.4, y, 1.0, 0.8, f"GELU\n4h/{world_size} cols", colour)
        box(5.7, y, 1.6, 0.8, f"rank {rank}: fc2 cols\n(h, 4h/{world_size})", colour)
        ax.annotate("", (7.6, y + 0.4), (7.3, y + 0.4), arrowprops={"arrowstyle": "->"})
        ax.text(7.45, y - 0.2, "partial sum", fontsize=7, ha="center")
        for start, stop in ((2.1, 2.5), (4.1, 4.4), (5.4, 5.7)):
            ax.annotate("", (stop, y + 0.4), (start, y + 0.4), arrowprops={"arrowstyle": "->"})
    ax.annotate("", (1.5, height / 2), (1.1, height / 2), arrowprops={"arrowstyle": "->"})
    box(8.6, height / 2 - 0.4, 1.2, 0.8, "Y\n(tokens, h)\nwhole on\nevery rank")
    ax.annotate("", (8.6, height / 2), (8.2, height / 2), arrowprops={"arrowstyle": "->"})
    ax.text(1.8, -0.35, "f: forward identity\nbackward all-reduce", ha="center", va="top", fontsize=8)
    ax.text(7.9, -0.35, "g: forward all-reduce\nbackward: exercise 2", ha="center", va="top", fontsize=8)
    ax.set_xlim(-0.1, 9.9)
    ax.set_ylim(-1.1, height + 0.1)
    ax.set_title(f"The Megatron MLP on {world_size} ranks: column-parallel fc1, row-parallel fc2, "
                 "one all-reduce each way")
    figure.tight_layout()
    return figure


def activation_memory(measured: dict, predicted: dict, unit_bytes: int):
    """Bytes one rank keeps for backward per layout, in units of batch x seq x hidden numbers, beside the paper's."""
    axes = new_axes(title="Activations kept for backward, one rank (LayerNorm + MLP)",
                    xlabel="", ylabel="numbers / (batch x seq x hidden)")
    names = list(measured)
    positions = range(len(names))
    axes.bar([p - 0.2 for p in positions], [measured[n] / unit_bytes for n in names], width=0.4, label="measured")
    axes.bar([p + 0.2 for p in positions], [predicted.get(n, float("nan")) for n in names], width=0.4,
             label="Korthikanti et al. (Table 2 terms)", alpha=0.6)
    axes.set_xticks(list(positions), names)
    axes.legend()
    return axes
