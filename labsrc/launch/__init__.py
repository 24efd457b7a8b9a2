"""The launcher: a lab, a module or a script under torchrun, watched to its end with nothing left behind.

    from labsrc import launch
    result = launch.run("setup", nproc=2, timeout=60)            # start(...).wait(): a RunResult, or it raises
    python -m labsrc.launch --nproc 2 setup                       # the same from a shell (launch/__main__.py)

What a launch asks for is checked first (request), spelled as torchrun commands (command), started under a GPU
lease where a class server has one (lease, launcher), watched (running) and read back (result); rank_entry is what
torchrun starts on every rank. Lessons import only the names below.
"""
from labsrc.core.processes import end_run, processes_of_run
from labsrc.core.world import RequestError
from labsrc.launch.command import ELASTIC_RDZV_CONF
from labsrc.launch.launcher import run, start, wait_all
from labsrc.launch.request import free_port
from labsrc.launch.result import LaunchError, LaunchInterrupted, LaunchTimeout, RankFailed, RunResult
from labsrc.launch.running import Launch

__all__ = ["run", "start", "wait_all", "Launch", "RunResult", "LaunchError", "LaunchTimeout", "LaunchInterrupted",
           "RankFailed", "RequestError", "processes_of_run", "end_run", "free_port", "ELASTIC_RDZV_CONF"]
