"""`python -m labsrc.bench nodes`: the emulated link and the all-reduce models measured at 1 Gbit/s and 100 Mbit/s.

    python -m labsrc.bench nodes                         # both rates, 2 nodes x 2 ranks and 4 nodes x 1 rank
    python -m labsrc.bench nodes --links 10gbit --link-seconds 0.3

For each rate, in one run: streamed throughput / set rate (target: within 15%), each all-reduce's measured
time / its model's prediction across sizes (target: within 25%), and the hierarchical all-reduce's speed-up
over the flat ring against the predicted one. Exit status 0 when every target is met, 1 when one is missed,
2 when emulated nodes are unavailable here (the reason is printed).
"""
from __future__ import annotations

import argparse
import sys

from labsrc.lessons.across_nodes import analysis
from labsrc.lessons.across_nodes.cost_model import MODEL_TOLERANCE, THROUGHPUT_TOLERANCE

TOPOLOGIES = ((2, 2), (4, 1))
"""(nodes, ranks per node): two levels of network, and a ring with a link on every hop."""


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def measure(link: str, link_seconds: float, repeats: int, timeout: float) -> dict:
    """{(nodes, ranks per node): RunResult} of the across_nodes lab's link and all-reduce experiments."""
    from labsrc import launch
    return {(nodes, per_node): launch.run("across_nodes", nproc=per_node, nnodes=nodes, link=link, timeout=timeout,
                                          echo=False, experiments=("link", "all_reduce"),
                                          link_seconds=link_seconds, repeats=repeats)
            for nodes, per_node in TOPOLOGIES}


def report(link: str, results: dict) -> tuple[list[str], bool]:
    """The printed lines for one rate and whether every target was met."""
    lines, met = [f"== link {link} =="], True
    for (nodes, per_node), result in results.items():
        where = f"{nodes} nodes x {per_node} rank{'s' if per_node > 1 else ''}"
        ratio = analysis.throughput_ratio(result)
        ok = abs(ratio - 1) <= THROUGHPUT_TOLERANCE
        met &= ok
        lines.append(f"{where}: throughput / set rate {ratio:.3f} (target 1 +- {THROUGHPUT_TOLERANCE:.2f}) "
                     f"{verdict(ok)}")
        for row in analysis.all_reduce_rows(result):  # judged where the shaper's credit is small (model_holds)
            met &= row["ok"] or not row["judged"]
            lines.append(f"  {row['algorithm']:>12} {row['bytes']:>10} B: measured {row['measured_s'] * 1e3:8.2f} ms, "
                         f"model {row['predicted_s'] * 1e3:8.2f} ms, "
                         f"measured / model {row['measured_s'] / row['predicted_s']:.3f}"
                         f" (target 1 +- {MODEL_TOLERANCE:.2f}) "
                         f"{verdict(row['ok']) if row['judged'] else 'not judged (shaper credit > 10%)'}")
        for row in analysis.speedups(result):
            met &= row["ok"]
            lines.append(f"  hierarchical speed-up at {row['bytes']:>10} B: measured {row['measured']:.2f}, predicted "
                         f"{row['predicted']:.2f}, measured / predicted {row['measured'] / row['predicted']:.3f} "
                         f"{verdict(row['ok'])}")
    return lines, met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labsrc.bench nodes", description=__doc__.splitlines()[0])
    parser.add_argument("--links", nargs="+", default=["1gbit", "100mbit"], help="link rates to measure")
    parser.add_argument("--link-seconds", type=float, default=0.2,
                        help="about how long the largest message takes on the link (sizes = rate x this)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per point; the fastest is kept")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each launch may take")
    options = parser.parse_args(argv)
    from labsrc.nodes import network
    from labsrc.core.world import RequestError
    available = network.availability()
    if not available.ok:
        print(f"emulated nodes are not available here: {available.reason}")
        return 2
    all_met = True
    for link in options.links:
        try:
            network.parse_link(link)  # a bad rate is refused before anything starts
        except RequestError as exc:
            parser.error(str(exc))
    for link in options.links:
        lines, met = report(link, measure(link, options.link_seconds, options.repeats, options.timeout))
        print("\n".join(lines), flush=True)
        all_met &= met
    print("every target met" if all_met else "some targets missed (see MISSED above)")
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
