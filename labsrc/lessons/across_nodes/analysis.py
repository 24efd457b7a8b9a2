"""What the across_nodes lab measured, set against the models: the rows notebook 06b and the benchmark assert on."""
from __future__ import annotations

from labsrc.lessons.across_nodes.cost_model import (MODELS, SHAPER_CREDIT_BYTES, Layers, judge, lesson06_time_s,
                                                    link_payload_bytes, model_holds, node_count_time_s, relative_error,
                                                    scheme_time_s, step_messages)
from labsrc.lessons.across_nodes.hierarchy import Topology
from labsrc.techniques.alpha_beta import AlphaBeta


def topology(result) -> Topology:
    return Topology(result.summary["nodes"], result.summary["ranks_per_node"])


def links(result) -> dict[str, AlphaBeta]:
    """{"inside": AlphaBeta, "across": AlphaBeta} fitted by the lab (only the levels this topology has)."""
    return {level: AlphaBeta(**fit) for level, fit in result.summary.get("fits", {}).items()}


def link_bits(result) -> int | None:
    """The set rate in bit/s, None when the run had no shaped link (the one-host path)."""
    return result.summary.get("link_bits")


def throughput_ratio(result) -> float | None:
    """Streamed bytes per second across nodes / the set rate; None without a shaped link."""
    rows = result.of_kind("throughput", rank=0)
    if not rows or not rows[0]["set_bytes_per_s"]:
        return None
    return rows[0]["bytes_per_s"] / rows[0]["set_bytes_per_s"]


def all_reduce_rows(result, bandwidth_of: AlphaBeta | None = None) -> list[dict]:
    """Per (algorithm, bytes): fastest measured seconds, its model's prediction and relative error.

    The model of each algorithm (cost_model.MODELS) on the fitted links; lesson 06's extrapolation
    beside it. bandwidth_of: a link whose bandwidth replaces the inter-node link's (its latency stays): given
    the inside link, the mistake the check must catch, the node's bandwidth taken for the network's (a run of
    one rank per node has no inside link of its own: take another run's).
    """
    fitted, shape = links(result), topology(result)
    inside, across = fitted.get("inside"), fitted["across"]
    if bandwidth_of is not None:
        across = AlphaBeta(across.alpha_s, bandwidth_of.beta_s_per_byte, across.r2)
    rows = []
    for record in result.of_kind("all_reduce", rank=0):
        predicted = MODELS[record["algorithm"]](record["bytes"], shape, inside, across)
        lesson06 = lesson06_time_s(record["bytes"], shape, inside, across)
        node_count = node_count_time_s(record["bytes"], shape, inside, across)
        rows.append({"algorithm": record["algorithm"], "bytes": record["bytes"], "measured_s": record["fastest_s"],
                     "predicted_s": predicted, "error": relative_error(record["fastest_s"], predicted),
                     "ok": judge(record["fastest_s"], predicted),
                     "judged": model_holds(record["algorithm"], record["bytes"], shape),
                     "lesson06_s": lesson06, "lesson06_error": relative_error(record["fastest_s"], lesson06),
                     "node_count_error": relative_error(record["fastest_s"], node_count)})
    return sorted(rows, key=lambda row: (row["algorithm"], row["bytes"]))


def speedups(result) -> list[dict]:
    """Per size: measured flat / hierarchical against the models' ratio (2 nodes of 2 ranks or more)."""
    rows = {(r["algorithm"], r["bytes"]): r for r in all_reduce_rows(result)}
    out = []
    for (name, nbytes), flat in sorted(rows.items()):
        hierarchical = rows.get(("hierarchical", nbytes))
        if name == "flat" and hierarchical:
            measured = flat["measured_s"] / hierarchical["measured_s"]
            predicted = flat["predicted_s"] / hierarchical["predicted_s"]
            out.append({"bytes": nbytes, "measured": measured, "predicted": predicted,
                        "error": relative_error(measured, predicted), "ok": judge(measured, predicted)})
    return out


def link_bytes_rows(result) -> list[dict]:
    """Per algorithm: bytes node 0's interface sent in one all-reduce, against the payload the model sends across
    (ratio: sent / payload); empty off emulated nodes."""
    rows = []
    for record in result.of_kind("link_bytes", rank=0):
        payload = link_payload_bytes(record["algorithm"], record["bytes"], topology(result))
        rows.append({"algorithm": record["algorithm"], "bytes": record["bytes"], "sent": record["sent"],
                     "payload": payload, "ratio": record["sent"] / payload})
    return sorted(rows, key=lambda row: row["algorithm"])


def scheme_rows(result) -> list[dict]:
    """Per (scheme, level): the step's bytes, fastest measured seconds and the model's, from the fitted links.

    Across nodes, the two pairs of a level share each node's link (sharing 2); inside, each node has its own.
    """
    fitted = links(result)
    if "layers" not in result.summary:
        return []
    schemes = step_messages(Layers(**result.summary["layers"]))
    rows = []
    for record in result.of_kind("scheme", rank=0):
        sharing = result.summary["ranks_per_node"] if record["level"] == "across" else 1
        predicted = scheme_time_s(record["operation"], schemes[record["scheme"]]["messages"],
                                  fitted[record["level"]], sharing)
        # The least time the shaped link allows (across only): what this rank sent, less the shaper's credit and
        # the largest message (it may still be queued when the rank's step returns), at the set rate.
        early = SHAPER_CREDIT_BYTES + max(schemes[record["scheme"]]["messages"])
        floor = (max(0.0, record["sent"] - early) / (link_bits(result) / 8)
                 if record["level"] == "across" and link_bits(result) else 0.0)
        rows.append({"scheme": record["scheme"], "level": record["level"], "messages": record["messages"],
                     "bytes": record["bytes"], "sent": record["sent"], "measured_s": record["fastest_s"],
                     "predicted_s": predicted, "error": relative_error(record["fastest_s"], predicted),
                     "floor_s": floor})
    return rows


def local_sgd_rows(result) -> list[dict]:
    """Rank 0's local SGD runs (communication times are the slowest rank's), k = 1 first."""
    return sorted(result.of_kind("local_sgd", rank=0), key=lambda row: row["every"])


def hierarchical_checks(result) -> list[dict]:
    """Every rank's hierarchical all-reduce checks: size, max_error, bytes inside and across."""
    return result.of_kind("hierarchical_check")
