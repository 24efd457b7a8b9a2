"""Deck 06b's figures: the link, all-reduce against the model, each parallelism's step, from ci runs on emulated nodes.

Where emulated nodes are unavailable the same launches run on loopback and the figures say so in their titles.
"""
from __future__ import annotations


def make(save):
    import matplotlib.pyplot as plt
    from labsrc import launch
    from labsrc.lessons.across_nodes import analysis
    from labsrc.nodes import network
    from labsrc.lessons.across_nodes import plots
    link = "100mbit" if network.availability().ok else None
    two = launch.run("across_nodes", nproc=2, nnodes=2, link=link, timeout=240, echo=False,
                     experiments=("link", "all_reduce", "parallelism"))
    four = launch.run("across_nodes", nproc=1, nnodes=4, link=link, timeout=240, echo=False,
                      experiments=("link", "all_reduce"))
    save("link", plots.link_figure(two).figure)
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.2))
    inside = analysis.links(two).get("inside")
    plots.all_reduce_figure(two, left, inside)
    plots.all_reduce_figure(four, right, inside)
    figure.tight_layout()
    save("all_reduce", figure)
    save("schemes", plots.schemes_figure(two).figure)
