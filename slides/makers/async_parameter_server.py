"""Deck 11's figures: staleness, loss curves, bytes into the server and local SGD, from a ci run of the lab."""
from __future__ import annotations


def make(save):
    from labsrc import launch
    from labsrc.labs.async_parameter_server import Options
    from labsrc.plots import async_parameter_server as plots
    result = launch.run("async_parameter_server", nproc=3, timeout=240, echo=False)
    save("staleness", plots.staleness_histogram(result, Options.make().bound))
    save("loss_curves", plots.loss_curves(result))
    save("server_bytes", plots.bytes_into_server(result))
    save("local_sgd", plots.local_sgd_curves(result))
