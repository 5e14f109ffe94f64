"""The torchrun world: process groups, device, seeds, rank roles and FSDP2 wrapping.

Every torch.distributed set-up call in minirl lives here; the rest of the code asks this
module for the rank, the device and the collectives and never which backend it runs on.

- Under torchrun the default group spans all ranks (gloo on CPU, NCCL on CUDA).
- Without a launcher (`python -m minirl.grpo`) `init()` makes a world of one with the same
  environment torchrun would set, so one code path serves both.
- `grid.gpu_placement=colocated`: every rank generates and trains.
  `disaggregated`: ranks [0, R) generate only, [R, N) train only. vLLM hangs if it is built
  on some ranks of a group that spans all of them (ENV-NOTES.md), so under disaggregated
  placement each side forms its own group on its own port and the two sides talk through a
  TCPStore (`init_disaggregated`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import signal
import socket
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class World:
    rank: int          # rank in the group this process trains in (the default group)
    world_size: int    # ranks in that group
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init() -> World:
    """Join the torchrun world, or make a world of one when started without a launcher."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _device(local_rank)
    if not torch.cuda.is_available():
        # Ranks sharing a CPU slow each other down badly when each spawns a full thread pool
        # (ENV-NOTES.md: 2 x 2 threads on 2 cores was ~18x slower than 2 x 1).
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                rank=rank, world_size=world, device_id=device if device.type == "cuda" else None)
    return World(rank, world, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch the same on every rank (model init must agree across ranks)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_deterministic() -> None:
    """`rl.deterministic`: deterministic kernels everywhere (spec "A determinism mode").

    The trap: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it creates its handle, so it must be in
    the LAUNCH environment (`CUBLAS_WORKSPACE_CONFIG=:4096:8 torchrun ...`). Setting it here is
    only safe while CUDA is still uninitialised; once it is up, this raises rather than warns.
    """
    if torch.cuda.is_available() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        if torch.cuda.is_initialized():
            raise RuntimeError("--rl.deterministic: CUDA is already initialised without CUBLAS_WORKSPACE_CONFIG; "
                               "launch with CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():  # flash / memory-efficient attention backward is not deterministic
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)


@contextlib.contextmanager
def private_world(port: int | None = None):
    """Environment for building a single-process vLLM engine inside a larger torchrun world.

    vLLM reads RANK/WORLD_SIZE/MASTER_PORT when it builds its own groups; giving it a world of
    one on a fresh port keeps it from joining (and hanging on) the ranks that never build an engine.
    """
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_PORT=str(port or free_port()), TORCHELASTIC_USE_AGENT_STORE="False")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class Roles:
    """Which side(s) a torchrun rank plays. Colocated: both; disaggregated: exactly one."""

    global_rank: int
    global_world: int
    rollout_ranks: int  # R; 0 when colocated

    @property
    def colocated(self) -> bool:
        return self.rollout_ranks == 0

    @property
    def generates(self) -> bool:
        return self.colocated or self.global_rank < self.rollout_ranks

    @property
    def trains(self) -> bool:
        return self.colocated or self.global_rank >= self.rollout_ranks

    @property
    def train_ranks(self) -> list[int]:
        return list(range(self.rollout_ranks, self.global_world))


def init_disaggregated(rollout_ranks: int, store_port_offset: int = 1) -> tuple[Roles, World | None, dist.TCPStore]:
    """Disaggregated start-up (call INSTEAD of `init()` under torchrun).

    Train ranks [R, N) form the default process group among themselves on MASTER_PORT + 2;
    rollout ranks form none (each later builds its engine in a `private_world`). Every rank
    joins one TCPStore on MASTER_PORT + `store_port_offset`, hosted by global rank 0, through
    which the two sides exchange groups and weights. Returns (roles, train World or None, store).
    """
    g_rank, g_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    roles = Roles(g_rank, g_world, rollout_ranks)
    addr, base = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
    # Long timeout: a rollout rank waits on the store for the next policy version for a whole train step.
    store = dist.TCPStore(addr, base + store_port_offset, g_world, is_master=g_rank == 0, use_libuv=True,
                          timeout=datetime.timedelta(minutes=30))
    if not roles.trains:
        return roles, None, store
    t_rank, t_world = g_rank - rollout_ranks, g_world - rollout_ranks
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _device(local_rank)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // g_world))
    train_store = dist.TCPStore(addr, base + 2, t_world, is_master=t_rank == 0, use_libuv=True)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=train_store,
                            rank=t_rank, world_size=t_world)
    os.environ.update(RANK=str(t_rank), WORLD_SIZE=str(t_world))
    return roles, World(t_rank, t_world, local_rank, device), store


# ---- FSDP2 ----

def shard(model: torch.nn.Module, world: World, param_dtype: torch.dtype) -> torch.nn.Module:
    """FSDP2 the torchtitan way: `fully_shard` every decoder block, then the root.

    Gradients are reduced as a data-parallel MEAN (FSDP2's default). minirl's loss divisors are
    DP means too (objective.py), so `mean_r(grad_sum_r / mean_r(N_r)) = grad(total sum) / total N`
    with no world-size factor anywhere.
    """
    mesh = init_device_mesh(world.device.type, (world.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in _decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    backbone = getattr(model, "model", None) or getattr(model, "backbone")
    return list(backbone.layers)


def full_parameters(model: torch.nn.Module):
    """Yield (name, full tensor) for every parameter, one all-gather at a time (a collective:
    every rank of the group must iterate to the end). Peak memory is one full parameter."""
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        yield name, full.detach()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce over the default group; `avg` is sum / world size (gloo has no AVG)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "avg":
            t /= dist.get_world_size()
    return t


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def sigterm_flag():
    """SIGTERM (torchrun forwards it to every rank) asks for an emergency save at the next step
    boundary. Returns a check that every rank of the default group calls at the same point; they
    agree through a max all-reduce, so they all save and stop, or none does."""
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))
    return lambda: bool(all_reduce(torch.tensor([float(bool(got))]), "max").item())
