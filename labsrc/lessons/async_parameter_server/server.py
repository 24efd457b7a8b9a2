"""A parameter server from point-to-point messages: rank 0 holds the parameters, workers pull them and push gradients.

Four modes on one seeded regression problem:
  sync     the server waits for one gradient from every worker, applies their mean: one update per round;
  async    the server applies each gradient the moment it arrives, whatever version it was computed on;
  bounded  async, but a gradient more than `bound` updates old (its staleness) is rejected, not applied;
  ssp      stale synchronous parallel (Ho et al. 2013): every gradient is applied at once, but a worker's clock
           (gradients it has pushed) may run at most `clock_bound` ahead of the slowest worker's: a faster worker's
           reply is held until the slowest catches up. Nothing is dropped; fast workers wait instead.
The server handles messages in arrival order and records every one (`Update`), so a single process can replay
the run (labsrc.lessons.async_parameter_server.analysis.replay) and must get the same parameters bit for bit. It also
records, per reply, how long the worker was held and the clock gap it was released at (every mode, so async's
unbounded gap and SSP's bounded one are measured the same way).
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

MODES = ("sync", "async", "bounded", "ssp")
GRADIENT_HEADER = 3
"""A gradient message is [worker rank, worker step, version it was computed on, gradient (parameters,)]."""
REPLY_HEADER = 2
"""A reply is [status (1 continue, 0 stop), version, parameters (parameters,)]."""
CONTINUE, STOP = 1.0, 0.0


@dataclass(frozen=True)
class Problem:
    """A seeded linear regression y = X w_true + noise; feature scales 0.3..1.5 so it needs a few hundred steps."""

    features: int = 16
    samples: int = 1024
    batch: int = 16
    noise: float = 0.1
    seed: int = 0


def make_data(problem: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """X (samples, features) and y (samples,), the same in every process for the same problem."""
    generator = torch.Generator().manual_seed(problem.seed)
    scales = torch.linspace(0.3, 1.5, problem.features)
    inputs = torch.randn(problem.samples, problem.features, generator=generator) * scales
    true_weights = torch.randn(problem.features, generator=generator)
    targets = inputs @ true_weights + problem.noise * torch.randn(problem.samples, generator=generator)
    return inputs, targets


def initial_parameters(problem: Problem) -> torch.Tensor:
    """The starting weights (features,): zeros, on every rank."""
    return torch.zeros(problem.features)


def batch_rows(problem: Problem, worker: int, step: int) -> torch.Tensor:
    """Row indices (batch,) of worker's step-th batch: seeded by (seed, worker, step), so a replay draws the same."""
    generator = torch.Generator().manual_seed(problem.seed * 1_000_003 + worker * 100_003 + step)
    return torch.randint(problem.samples, (problem.batch,), generator=generator)


def gradient(inputs, targets, parameters, rows) -> torch.Tensor:
    """Gradient (features,) of the mean squared error on rows: 2/b X_bᵀ (X_b w - y_b)."""
    batch_inputs = inputs[rows]
    residual = batch_inputs @ parameters - targets[rows]
    return batch_inputs.T @ residual * (2.0 / len(rows))


def full_loss(inputs, targets, parameters) -> float:
    """Mean squared error of parameters on the whole data set (the noise floor is noise²)."""
    return float(((inputs @ parameters - targets) ** 2).mean())


def within_bound(server_version: int, gradient_version: int, bound: int) -> bool:
    """Bounded staleness's admission check: apply a gradient at most `bound` updates old."""
    return server_version - gradient_version <= bound


@dataclass(frozen=True)
class Settings:
    """One parameter-server run."""

    mode: str
    """sync, async, bounded or ssp."""
    workers: tuple[int, ...]
    """The ranks that compute gradients (the server is rank 0)."""
    gradients: int
    """Gradients the server applies before it tells the workers to stop."""
    lr: float
    """SGD learning rate of every applied update."""
    bound: int = 0
    """Largest staleness admitted in bounded mode."""
    delays_s: tuple[float, ...] = ()
    """Each worker's mean compute delay in seconds (worker i takes delays_s[i % len]); empty: none."""
    jitter: float = 0.0
    """Each delay is drawn uniformly in mean * (1 ± jitter), seeded by (worker, step)."""
    timeout_s: float = 30.0
    """Seconds any one send or receive may wait before it raises."""
    clock_bound: int = 0
    """ssp mode: the most clocks (gradients pushed) a worker may be ahead of the slowest before it is held."""


def compute_delay(settings: Settings, problem: Problem, index: int, step: int) -> float:
    """Seconds worker number `index` sleeps in its step-th gradient: a slower (or busier) machine, seeded."""
    if not settings.delays_s:
        return 0.0
    mean = settings.delays_s[index % len(settings.delays_s)]
    generator = torch.Generator().manual_seed(problem.seed * 7919 + index * 104_729 + step)
    return mean * (1.0 + settings.jitter * (2.0 * float(torch.rand(1, generator=generator)) - 1.0))


@dataclass
class Traffic:
    """Messages and bytes that crossed the server's links."""

    messages_in: int = 0
    bytes_in: int = 0
    messages_out: int = 0
    bytes_out: int = 0


def _wait(work, timeout_s: float) -> None:
    work.wait(datetime.timedelta(seconds=timeout_s))


def send(tensor: torch.Tensor, destination: int, timeout_s: float) -> int:
    """Send and wait at most timeout_s; returns the bytes sent."""
    _wait(dist.isend(tensor, destination), timeout_s)
    return tensor.numel() * tensor.element_size()


def receive(buffer: torch.Tensor, source: int | None, timeout_s: float) -> int:
    """Receive into buffer from source (None: whichever rank sends first), waiting at most timeout_s."""
    _wait(dist.irecv(buffer, source), timeout_s)
    return buffer.numel() * buffer.element_size()


@dataclass
class ServerState:
    """What the server holds: the parameters, their version (updates applied so far), and what it recorded."""

    parameters: torch.Tensor
    version: int = 0
    applied: int = 0
    updates: list = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    round: list = field(default_factory=list)
    clocks: dict = field(default_factory=dict)
    """{worker: gradients it has pushed and the server has handled}: the worker's clock."""
    last: dict = field(default_factory=dict)
    """{worker: the record of its gradient the server has not answered yet}."""
    held: list = field(default_factory=list)
    """ssp: workers whose reply waits for the slowest worker, in the order they arrived."""


def clock_gap(state: ServerState, worker: int) -> int:
    """How many clocks worker is ahead of the slowest worker (0 for the slowest)."""
    return state.clocks[worker] - min(state.clocks.values())


def _reply(state: ServerState, worker: int, status: float, timeout_s: float) -> None:
    message = torch.cat([torch.tensor([status, float(state.version)]), state.parameters])
    state.traffic.bytes_out += send(message, worker, timeout_s)
    state.traffic.messages_out += 1


def _note(state: ServerState, data, arrival: dict, applied: bool, start: float) -> None:
    """Record one processed gradient: who, which version, how stale, applied or not, the loss after it."""
    record = {**arrival, "server_version": arrival["arrived_at_version"], "applied": applied,
              "loss": full_loss(*data, state.parameters), "seconds": time.perf_counter() - start,
              "held": False, "held_s": 0.0, "clock_gap": None}
    state.updates.append(record)
    state.last[arrival["worker"]] = record


def _answer(state: ServerState, worker: int, status: float, at_once: bool, timeout_s: float) -> None:
    """Reply to worker's last gradient; record how long it was held and (if it goes on) its clock gap."""
    record = state.last.pop(worker)
    record["held"] = not at_once
    record["held_s"] = time.perf_counter() - record["received"]
    record["clock_gap"] = clock_gap(state, worker) if status == CONTINUE else None
    _reply(state, worker, status, timeout_s)


def _handle(state: ServerState, data, settings: Settings, arrival: dict, admit, start: float) -> list[int]:
    """Apply or hold or reject one gradient; return the workers to answer now."""
    if settings.mode == "sync":
        state.round.append(arrival)
        if len(state.round) < len(settings.workers):
            return []
        mean = torch.stack([item["gradient"] for item in state.round]).mean(0)
        state.parameters = state.parameters - settings.lr * mean
        state.version += 1
        state.applied += len(state.round)
        finished, state.round = state.round, []
        for item in finished:
            _note(state, data, item, True, start)
        return [item["worker"] for item in finished]
    admitted = settings.mode != "bounded" or admit(state.version, arrival["gradient_version"], settings.bound)
    if admitted:
        state.parameters = state.parameters - settings.lr * arrival["gradient"]
        state.version += 1
        state.applied += 1
    _note(state, data, arrival, admitted, start)
    if settings.mode != "ssp":
        return [arrival["worker"]]
    state.held.append(arrival["worker"])  # SSP: go on only while within clock_bound of the slowest worker
    released = [worker for worker in state.held if clock_gap(state, worker) <= settings.clock_bound]
    state.held = [worker for worker in state.held if worker not in released]
    return released


def serve(data, problem: Problem, settings: Settings, admit=within_bound) -> dict:
    """Rank 0's loop: answer every worker, handle gradients in arrival order until `gradients` are applied.

    Returns {"parameters": final (features,), "updates": one dict per gradient handled, "traffic": Traffic,
    "seconds": wall time, "drained": gradients that arrived after the stop}.
    """
    state = ServerState(initial_parameters(problem), clocks=dict.fromkeys(settings.workers, 0))
    buffer = torch.empty(GRADIENT_HEADER + problem.features)
    start = time.perf_counter()
    for worker in settings.workers:
        _reply(state, worker, CONTINUE, settings.timeout_s)
    active, drained = set(settings.workers), 0
    while active:
        state.traffic.bytes_in += receive(buffer, None, settings.timeout_s)
        state.traffic.messages_in += 1
        received = time.perf_counter()
        worker, step, gradient_version = (int(value) for value in buffer[:GRADIENT_HEADER].tolist())
        if state.applied >= settings.gradients:  # stopping: this gradient was in flight when the run ended
            drained += 1
            _reply(state, worker, STOP, settings.timeout_s)
            active.discard(worker)
            continue
        arrival = {"order": len(state.updates) + len(state.round) + drained, "worker": worker,
                   "worker_step": step, "gradient_version": gradient_version,
                   "arrived_at_version": state.version, "staleness": state.version - gradient_version,
                   "gradient": buffer[GRADIENT_HEADER:].clone(), "received": received}
        state.clocks[worker] += 1
        answered = _handle(state, data, settings, arrival, admit, start)
        if state.applied >= settings.gradients:  # the run is over: held workers are told to stop as well
            answered, state.held = answered + state.held, []
        for each in answered:
            status = STOP if state.applied >= settings.gradients else CONTINUE
            _answer(state, each, status, each == worker, settings.timeout_s)
            if status == STOP:
                active.discard(each)
    for update in state.updates:
        del update["gradient"], update["received"]
    return {"parameters": state.parameters, "updates": state.updates, "traffic": state.traffic,
            "seconds": time.perf_counter() - start, "drained": drained}


def work(rank: int, data, problem: Problem, settings: Settings) -> dict:
    """A worker's loop: receive (status, version, parameters), compute a gradient, send it, until told to stop."""
    index = settings.workers.index(rank)
    reply = torch.empty(REPLY_HEADER + problem.features)
    step = 0
    receive(reply, 0, settings.timeout_s)
    while reply[0].item() == CONTINUE:
        version, parameters = int(reply[1].item()), reply[REPLY_HEADER:].clone()
        grad = gradient(*data, parameters, batch_rows(problem, rank, step))
        time.sleep(compute_delay(settings, problem, index, step))
        header = torch.tensor([float(rank), float(step), float(version)])
        send(torch.cat([header, grad]), 0, settings.timeout_s)
        step += 1
        receive(reply, 0, settings.timeout_s)
    return {"steps": step}


def run(rank: int, data, problem: Problem, settings: Settings, admit=within_bound) -> dict | None:
    """This rank's part of one run: the server's result on rank 0, a worker's on workers, None elsewhere."""
    if settings.mode not in MODES:
        raise ValueError(f"mode {settings.mode!r} is not one of {MODES}")
    if rank == 0:
        return serve(data, problem, settings, admit)
    if rank in settings.workers:
        return work(rank, data, problem, settings)
    return None
