"""Figures and tables of notebook 06b (across nodes), drawn from the across_nodes lab's records and its analysis."""
from __future__ import annotations

from labsrc.core.figures import new_axes
from labsrc.lessons.across_nodes import analysis
from labsrc.techniques.alpha_beta import AlphaBeta, ring_allreduce_time_s


def _where(result) -> str:
    bits = analysis.link_bits(result)
    per_node = result.summary["ranks_per_node"]
    shape = f"{result.summary['nodes']} nodes x {per_node} rank{'s' if per_node > 1 else ''}"
    return f"{shape}, {bits / 1e6:g} Mbit/s link" if bits else f"{shape}, loopback only"


def layout_table(result) -> str:
    """Rank, node, the node's address: where every rank ran."""
    lines = [f"{'rank':>4} {'node':>4}  address"]
    for row in sorted(result.of_kind("layout"), key=lambda r: r["rank"]):
        lines.append(f"{row['rank']:>4} {row['node']:>4}  {row['node_address'] or '127.0.0.1 (shared loopback)'}")
    return "\n".join(lines)


def link_figure(result, ax=None):
    """Across: seconds per streamed message and the fitted link; inside: the nodes' reduce-scatter + all-gather."""
    ax = new_axes(f"The two levels ({_where(result)})", "message size (bytes)", "seconds", ax)
    fits, per_node = analysis.links(result), result.summary["ranks_per_node"]
    streamed = sorted(result.of_kind("link", rank=0), key=lambda r: r["bytes"])
    if streamed:
        sizes, fit = [r["bytes"] for r in streamed], fits["across"]
        ax.plot(sizes, [r["seconds"] for r in streamed], "o", color="C1", label="across: a message in a stream")
        ax.plot(sizes, [fit.time_s(s) for s in sizes], "-", color="C1", label=f"across link: {model_line(fit)}")
    inside = sorted(result.of_kind("inside", rank=0), key=lambda r: r["bytes"])
    if inside:
        sizes, fit = [r["bytes"] for r in inside], fits["inside"]
        ax.plot(sizes, [r["seconds"] for r in inside], "o", color="C0",
                label=f"inside: reduce-scatter + all-gather on {per_node} ranks")
        ax.plot(sizes, [ring_allreduce_time_s(s, per_node, fit) for s in sizes], "-", color="C0",
                label=f"inside link (ring_link): {model_line(fit)}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    return ax


def all_reduce_figure(result, ax=None, inside: AlphaBeta | None = None):
    """Measured all-reduce times (points) against each model (lines), and with `inside`'s bandwidth across (dotted)."""
    ax = new_axes(f"All-reduce across nodes ({_where(result)})", "message size (bytes)", "seconds", ax)
    inside = inside or analysis.links(result).get("inside")
    rows = analysis.all_reduce_rows(result)
    wrong = analysis.all_reduce_rows(result, bandwidth_of=inside) if inside else []
    for index, name in enumerate(sorted({r["algorithm"] for r in rows})):
        mine = [r for r in rows if r["algorithm"] == name]
        sizes = [r["bytes"] for r in mine]
        ax.plot(sizes, [r["measured_s"] for r in mine], "o", color=f"C{index}", label=f"{name}: measured")
        ax.plot(sizes, [r["predicted_s"] for r in mine], "-", color=f"C{index}", label=f"{name}: model")
        if wrong:
            ax.plot(sizes, [r["predicted_s"] for r in wrong if r["algorithm"] == name], ":", color=f"C{index}",
                    label=f"{name}: model with the inside bandwidth across")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    return ax


def all_reduce_table(result) -> str:
    """Per algorithm and size: measured, model, error, lesson 06's extrapolation and its error."""
    lines = [f"{'algorithm':>12} {'bytes':>9} {'measured ms':>12} {'model ms':>9} {'error':>7} "
             f"{'lesson 06 ms':>13} {'error':>7}"]
    for r in analysis.all_reduce_rows(result):
        lines.append(f"{r['algorithm']:>12} {r['bytes']:>9} {r['measured_s'] * 1e3:>12.2f} "
                     f"{r['predicted_s'] * 1e3:>9.2f}"
                     f" {r['error']:>+7.0%} {r['lesson06_s'] * 1e3:>13.2f} {r['lesson06_error']:>+7.0%}")
    return "\n".join(lines)


def schemes_figure(result, ax=None):
    """Communication seconds per step of each parallelism, inside a node and across nodes."""
    import numpy as np
    rows = analysis.scheme_rows(result)
    ax = new_axes(f"One step's communication ({_where(result)})", "", "seconds (log)", ax)
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    x = np.arange(len(schemes))
    for offset, level in ((-0.2, "inside"), (0.2, "across")):
        heights = [next(r["measured_s"] for r in rows if (r["scheme"], r["level"]) == (s, level)) for s in schemes]
        ax.bar(x + offset, heights, 0.4, label=level)
    ax.set_xticks(x, [f"{s}\n{next(r['bytes'] for r in rows if r['scheme'] == s) / 1e3:.0f} kB" for s in schemes])
    ax.set_yscale("log")
    ax.legend()
    return ax


def schemes_table(result) -> str:
    lines = [f"{'scheme':>9} {'level':>7} {'messages':>8} {'bytes':>8} {'measured ms':>12} {'model ms':>9} "
             f"{'error':>7}"]
    for r in analysis.scheme_rows(result):
        lines.append(f"{r['scheme']:>9} {r['level']:>7} {r['messages']:>8} {r['bytes']:>8} "
                     f"{r['measured_s'] * 1e3:>12.2f} {r['predicted_s'] * 1e3:>9.2f} {r['error']:>+7.0%}")
    return "\n".join(lines)


def local_sgd_table(result) -> str:
    lines = [f"{'every k':>7} {'averages':>8} {'communication ms':>17} {'total ms':>9} {'loss':>9} {'vs sync':>8} "
             f"{'one-process reference':>22}"]
    for r in analysis.local_sgd_rows(result):
        lines.append(f"{r['every']:>7} {r['calls']:>8} {r['communication_s'] * 1e3:>17.1f} {r['total_s'] * 1e3:>9.1f}"
                     f" {r['loss']:>9.2f} {r['loss'] / r['sync_loss'] - 1:>+8.2%} {r['reference_loss']:>22.2f}")
    return "\n".join(lines)


def show_nodes(result, inside: AlphaBeta | None = None) -> None:
    """The link and the all-reduce figures of one run side by side, and the table (inside: see all_reduce_figure)."""
    import matplotlib.pyplot as plt
    _, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    link_figure(result, left)
    all_reduce_figure(result, right, inside)
    plt.tight_layout()
    plt.show()
    print(all_reduce_table(result))


def model_line(link: AlphaBeta) -> str:
    return f"alpha {link.alpha_s * 1e6:.0f} us, 1/beta {link.bandwidth_bytes_per_s / 1e6:.1f} MB/s"


def hierarchy_diagram():
    """The hierarchical all-reduce on 2 nodes x 2 ranks: who sends what to whom in each of its three phases.

    Each rank starts with a tensor of two halves (a, b). Inside arrows stay in a node (fast); across arrows
    cross the node link (slow), one shard per rank, so each node sends the tensor's size once, not 1.5 times.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
    phases = [("1. reduce-scatter inside each node", "inside",
               ["a0 b0", "a1 b1", "a2 b2", "a3 b3"], ["a0+a1", "b0+b1", "a2+a3", "b2+b3"]),
              ("2. all-reduce of one shard across nodes", "across",
               ["a0+a1", "b0+b1", "a2+a3", "b2+b3"], ["A", "B", "A", "B"]),
              ("3. all-gather inside each node", "inside", ["A", "B", "A", "B"], ["A B", "A B", "A B", "A B"])]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    spots = {0: (0.25, 0.68), 1: (0.25, 0.28), 2: (0.75, 0.68), 3: (0.75, 0.28)}  # rank: (x, y); nodes left, right
    for ax, (title, level, before, after) in zip(axes, phases):
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.axis("off")
        for node, x in ((0, 0.25), (1, 0.75)):
            ax.add_patch(FancyBboxPatch((x - 0.19, 0.08), 0.38, 0.8, boxstyle="round,pad=0.01", fill=False,
                                        edgecolor="0.5"))
            ax.text(x, 0.92, f"node {node}", ha="center", fontsize=9)
        for rank, (x, y) in spots.items():
            ax.text(x, y + 0.07, f"rank {rank}: {before[rank]}", ha="center", fontsize=8)
            ax.text(x, y - 0.07, f"-> {after[rank]}", ha="center", fontsize=8, color="C2")
        pairs = [(0, 1), (2, 3)] if level == "inside" else [(0, 2), (1, 3)]
        color = "C0" if level == "inside" else "C3"
        for a, b in pairs:
            (xa, ya), (xb, yb) = spots[a], spots[b]
            if level == "inside":  # beside the labels, inside the node's box
                xa, xb, ya, yb = xa + 0.15, xb + 0.15, ya + 0.05, yb - 0.05
            ax.add_patch(FancyArrowPatch((xa, ya), (xb, yb), arrowstyle="<->", mutation_scale=12, color=color,
                                         shrinkA=14, shrinkB=14, linewidth=2))
        ax.text(0.5, 0.0, "fast: loopback / NVLink" if level == "inside" else "slow: the node link, S/2 per rank",
                ha="center", fontsize=8, color=color)
    figure.suptitle("Hierarchical all-reduce on 2 nodes x 2 ranks: A = a0+a1+a2+a3, B = b0+b1+b2+b3", fontsize=10)
    plt.tight_layout()
    plt.show()
