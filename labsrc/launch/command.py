"""The torchrun command of one node's agent and the environment every rank starts with.

    torchrun_command(target, nproc, nodes, args, run_id)    # [python, -m, torch.distributed.run, ..., rank entry]
    child_environment(ranks, run_dir, run_id, backend, profile, own_store, extra)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from labsrc.core import runs
from labsrc.core.paths import python_path
from labsrc.core.processes import RUN_ID_ENV
from labsrc.core.world import BACKEND_ENV
from labsrc.launch.request import Nodes, Target

ELASTIC_RDZV_CONF = "last_call_timeout=3,join_timeout=60,keep_alive_interval=2,keep_alive_max_attempt=3"
OWN_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # torch's opt-out of sharing the rendezvous store with ranks
# torch versions the course runs restarts and nodes on with OWN_STORE_ENV=1 (the failure without it: 2.14.1)
OWN_STORE_TORCH = ((2, 11), (2, 14))


def torchrun_command(target: Target, nproc: int, nodes: Nodes, target_args: list[str], run_id: str,
                     max_restarts: int = 0, port: int | None = None, local_addr: str = "127.0.0.1",
                     rendezvous_host: str = "127.0.0.1", is_host: bool | None = None) -> list[str]:
    """One torchrun agent: standalone on loopback for one node, else a c10d rendezvous at rendezvous_host:port.

    Emulated nodes give each agent its node's own address (local_addr) and say which one hosts the store.
    """
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--max-restarts={max_restarts}", "--monitor-interval=0.1", f"--local-addr={local_addr}"]
    if nodes.maximum == 1 and port is None:
        command.append("--standalone")
    else:
        command += [f"--nnodes={nodes.spec}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous_host}:{port}",
                    f"--rdzv-id={run_id}"]
        if nodes.maximum > 1:
            host = "" if is_host is None else f",is_host={str(is_host).lower()}"
            command.append(f"--rdzv-conf={ELASTIC_RDZV_CONF}{host}")
    return command + ["-m", "labsrc.launch.rank_entry", *target.entry_argv, "--", *target_args]


def child_environment(ranks: int, run_dir: Path, run_id: str, backend: str | None, profile: str | None,
                      own_store: bool, extra: dict | None) -> dict:
    env = dict(os.environ)
    cores = os.cpu_count() or 1
    env.update({
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(max(1, cores // ranks)),  # ranks share the cores instead of fighting
        runs.RUN_DIR_ENV: str(run_dir),
        RUN_ID_ENV: run_id,
        "PYTHONPATH": python_path(),
    })
    if own_store:
        # Each attempt's ranks build a fresh store (OWN_STORE_ENV) instead of the one node rank 0's agent keeps for
        # its life: with that one, on torch 2.14.1, 10b's rejoin timed out in _assign_worker_ranks waiting for
        # role_info (an agent that knows the store's address does not publish it in a later round), and a restarted
        # attempt's gloo ranks were seen dialling the previous attempt's (dead) addresses, still in the kept store
        # ("connectFullMesh failed ... Connection refused"). Lessons 10/10b and cluster/ say so.
        env[OWN_STORE_ENV] = "1"
    if backend:
        env[BACKEND_ENV] = backend
    if profile:
        env["LABSRC_PROFILE"] = profile
    env.update(extra or {})
    return env
