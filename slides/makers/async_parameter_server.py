"""Deck 11's figures: staleness, clock gaps, loss curves, bytes into the server, local SGD and DiLoCo, from a ci run."""
from __future__ import annotations


def make(save):
    from labsrc import launch
    from labsrc.lessons.async_parameter_server.lab import Options
    from labsrc.lessons.async_parameter_server import plots
    result = launch.run("async_parameter_server", nproc=3, timeout=240, echo=False)
    save("staleness", plots.staleness_histogram(result, Options.make().bound))
    save("clock_gaps", plots.clock_gaps(result, Options.make().clock_bound))
    save("loss_curves", plots.loss_curves(result))
    save("server_bytes", plots.bytes_into_server(result))
    save("local_sgd", plots.local_sgd_curves(result))
    save("diloco", plots.diloco_curves(result))
