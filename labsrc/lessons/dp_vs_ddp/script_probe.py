"""What notebook 01b's checker sees of a DDP script: the script's main() run on this rank, its torch calls recorded.

    torchrun ... -m labsrc.lessons.dp_vs_ddp.script_probe --report-dir DIR [--fail] SCRIPT [-- ARGS]

The script stays plain torch. Here the calls a DDP script makes (the process group, the device, DistributedSampler,
DistributedDataParallel, small all_reduces, torch.save and torch.load) are wrapped, and each call the script itself
makes is noted in DIR/rank<r>.json. The file is rewritten after every note, so a run that stops early still says
how far it got. --fail makes the given make_optimizer raise InjectedFailure: the checker's failure run.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from labsrc.lessons.dp_vs_ddp.script_reference import load_script, parameter_checksum

SAVE_PAUSE_S = 0.5  # after torch.save, as a large checkpoint takes to write: a reader that skips the barrier
#                     then reads before "saved" every time, instead of winning a race by luck
SMALL = 8  # an all_reduce of at most this many elements is noted (a metric, not a gradient)


class InjectedFailure(RuntimeError):
    """Raised on purpose by the given make_optimizer in the checker's failure run."""


class Probe:
    """One rank's notes: what its script asked torch for, in order."""

    def __init__(self, folder: Path, script: Path):
        self.script = str(script)
        self.path = folder / f"rank{os.environ['RANK']}.json"
        self.model = None
        self.report = {"rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
                       "set_device": [], "group": None, "sampler": None, "set_epoch": [], "shards": [],
                       "ddp": None, "all_reduce": [], "events": [], "loaded": None, "error": None}
        folder.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        self.path.write_text(json.dumps(self.report))

    def note(self, key: str, value) -> None:
        if isinstance(self.report[key], list):
            self.report[key].append(value)
        else:
            self.report[key] = value
        self.save()

    def event(self, name: str, **fields) -> None:
        self.note("events", {"event": name, "time": time.time(), **fields})

    def called_by_script(self, depth: int = 2) -> bool:
        """Whether the wrapped call came from the script itself (not from torch's own use of the same function)."""
        return sys._getframe(depth).f_code.co_filename == self.script

    def checksum(self) -> float | None:
        return None if self.model is None else parameter_checksum(self.model.state_dict())

    def finish(self) -> None:
        """At exit: is the process group gone, and what are this rank's final weights?"""
        self.report.update(exited=True, group_destroyed=not dist.is_initialized(), parameter_checksum=self.checksum())
        self.save()


def group_timeout_s() -> float | None:
    """The default group's collective timeout in seconds, read from its backend (a private attribute: None on a
    torch without it)."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.group.WORLD._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def wrap_torch(probe: Probe) -> None:
    """Wrap the torch calls a DDP script makes, so that each notes what it did (for this process only)."""
    real = {"set_device": torch.cuda.set_device, "init": dist.init_process_group, "all_reduce": dist.all_reduce,
            "destroy": dist.destroy_process_group, "save": torch.save, "load": torch.load,
            "ddp": DistributedDataParallel.__init__, "sampler": DistributedSampler.__init__,
            "set_epoch": DistributedSampler.set_epoch, "iter": DistributedSampler.__iter__}

    def set_device(device):
        real["set_device"](device)
        probe.note("set_device", torch.cuda.current_device())

    def init_process_group(*args, **kwargs):
        real["init"](*args, **kwargs)
        device_id = kwargs.get("device_id")
        probe.note("group", {"backend": dist.get_backend(), "world_size": dist.get_world_size(),
                             "timeout_s": group_timeout_s(), "device_id": None if device_id is None else str(device_id)})

    def all_reduce(tensor, *args, **kwargs):
        noted = probe.called_by_script() and isinstance(tensor, torch.Tensor) and tensor.numel() <= SMALL
        before = tensor.detach().double().flatten().tolist() if noted else None
        work = real["all_reduce"](tensor, *args, **kwargs)
        if noted:
            if work is not None:  # async_op=True: finish it here to read the sum
                work.wait()
            probe.note("all_reduce", {"epochs_begun": len(probe.report["shards"]), "before": before,
                                      "after": tensor.detach().double().flatten().tolist()})
        return work

    def destroy_process_group(*args, **kwargs):
        probe.event("destroyed")
        real["destroy"](*args, **kwargs)

    def save(obj, f, *args, **kwargs):
        real["save"](obj, f, *args, **kwargs)
        if probe.called_by_script():
            time.sleep(SAVE_PAUSE_S)
            probe.event("saved")

    def load(f, *args, **kwargs):
        if not probe.called_by_script():
            return real["load"](f, *args, **kwargs)
        map_location = kwargs.get("map_location", args[0] if args else None)
        probe.event("loading", map_location=None if map_location is None else str(map_location))
        state = real["load"](f, *args, **kwargs)
        tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if isinstance(state, dict) else {}
        probe.note("loaded", {"device": str(next(iter(tensors.values())).device) if tensors else None,
                              "checksum": parameter_checksum(tensors)})
        return state

    def ddp_init(self, module, *args, **kwargs):
        real["ddp"](self, module, *args, **kwargs)
        probe.note("ddp", {"device_ids": self.device_ids,
                           "cuda_device": torch.cuda.current_device() if torch.cuda.is_available() else None})

    def sampler_init(self, *args, **kwargs):
        real["sampler"](self, *args, **kwargs)
        probe.note("sampler", {"num_replicas": self.num_replicas, "rank": self.rank, "seed": self.seed,
                               "shuffle": self.shuffle})

    def set_epoch(self, epoch):
        real["set_epoch"](self, epoch)
        probe.note("set_epoch", epoch)

    def sampler_iter(self):
        indices = list(real["iter"](self))
        probe.note("shards", {"epoch": self.epoch, "indices": indices})
        return iter(indices)

    torch.cuda.set_device, dist.init_process_group, dist.all_reduce = set_device, init_process_group, all_reduce
    dist.destroy_process_group, torch.save, torch.load = destroy_process_group, save, load
    DistributedDataParallel.__init__ = ddp_init
    DistributedSampler.__init__, DistributedSampler.set_epoch, DistributedSampler.__iter__ = (
        sampler_init, set_epoch, sampler_iter)


def wrap_given(module, probe: Probe, fail: bool) -> None:
    """The script's given make_model keeps the model for the checksum; make_optimizer raises in a failure run."""
    make_model, make_optimizer = module.make_model, module.make_optimizer

    def kept_model():
        probe.model = make_model()
        return probe.model

    def optimizer_or_failure(model):
        if fail:
            raise InjectedFailure("raised on purpose by the checker's failure run: is the group destroyed in a "
                                  "finally?")
        return make_optimizer(model)

    module.make_model, module.make_optimizer = kept_model, optimizer_or_failure


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-dir", required=True, type=Path)
    parser.add_argument("--fail", action="store_true", help="make_optimizer raises InjectedFailure")
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    script = options.script.resolve()
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    probe = Probe(options.report_dir, script)
    probe.save()
    atexit.register(probe.finish)
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    try:
        wrap_torch(probe)
        module = load_script(script)
        wrap_given(module, probe, options.fail)
        module.main()
    except BaseException as error:
        todo = re.match(r"TODO (\d+)", str(error)) if isinstance(error, NotImplementedError) else None
        frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == str(script)]
        probe.note("error", {"type": type(error).__name__, "message": str(error)[:1000],
                             "todo": int(todo[1]) if todo else None,
                             "line": f"line {frames[-1].lineno}: {frames[-1].line}" if frames else None})
        raise


if __name__ == "__main__":
    main()
