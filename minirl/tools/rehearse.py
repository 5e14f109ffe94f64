"""The GPU trainer rehearsed on a CPU: `--dry-run --rehearse` on both entrypoints.

    python -m minirl.ppo <a recipe's flags> --dry-run --rehearse --dry-run-world-size 8 --dry-run-device cuda

runs minirl's own trainer code for train rank 0 of the world the flags describe, on fake CUDA tensors
(torch's FakeTensorMode: a shape, a dtype and a device, no storage), the other ranks played by torch's
`fake` process group, the models built from config.json alone, and torch's FSDPMemTracker measuring:
- GRPO: one optimizer step of `grpo.update` on the first mini-batch, inside the hand-off;
- PPO: one step of `stream.TrainPump`, every chunk and the close, with the real refit's gather and
  bucket packing (disaggregated) or the hand-off's publish (colocated);
- both: then a checkpoint's and the export's work on the card (`_save_and_export`), without the writes.
Rows are the recipe's sizes at the full sequence length (the first micro-batch's two first rows half
as long, so packing runs too), in bf16 with float32 masters. It prints each model's peak per card by
category beside the plan's (plan.py), and the host reads per optimizer step (each a GPU sync). A CUDA
tensor meeting a CPU one stops it with the op and minirl's line (exit 1). What it cannot show: kernels'
workspaces, fragmentation, NCCL's buffers, vLLM's memory (the plan's engine share stands in).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import traceback

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from minirl.config import ConfigError
from minirl.tools import fakecuda

GIB = 2**30


# ---- the parent: compile the stand-ins once, rehearse in a child process ----

def run(argv: list[str], loop: str) -> None:
    """Rehearse `loop` ("grpo" or "ppo") with the flags `argv` in a child process: the loop's own command
    (`python -m minirl.<loop>`), which hands itself to `child`; exit as it did."""
    if torch.version.cuda or torch.version.hip:
        raise ConfigError("--rehearse plays a GPU on a CPU-only torch; this torch is built for GPUs: run the "
                          "recipe itself on one node to measure it")
    lib = fakecuda.library()
    env = {**os.environ, "LD_PRELOAD": " ".join(filter(None, (lib, os.environ.get("LD_PRELOAD"))))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # the child plays its own world
        env.pop(k, None)
    env["MINIRL_REHEARSAL_WORLD"] = os.environ.get("WORLD_SIZE", "1")
    env["MINIRL_REHEARSAL_CHILD"] = "1"  # launch.preflight: this dry run is the rehearsal itself
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # the fake backend's teardown warns of hooks it never had
    code = subprocess.call([sys.executable, "-m", f"minirl.{loop}", *argv], env=env)
    if code:
        raise SystemExit(code)


# ---- the child: fake CUDA, a fake world, the real trainer ----

def child(args, module) -> list[str]:
    """In the child `run` started (the stand-ins preloaded): rehearse train rank 0's step of the loop
    whose module is `module`, through that loop's own public functions, on fake CUDA."""
    import torch.distributed as tdist
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from minirl import dist
    from minirl.tools import plan

    if "fakecuda" not in os.environ.get("LD_PRELOAD", ""):
        raise ConfigError("the rehearsal runs under `--dry-run --rehearse`, which preloads its CUDA stand-ins")
    loop = type(args).LOOP
    world_size = args.dry_run_world_size or int(os.environ.get("MINIRL_REHEARSAL_WORLD", "1"))
    args.validate(world_size)
    hf, source = plan.model_config(args.model)
    if hf is None:
        raise ConfigError(f"--rehearse needs the model's config.json; none is readable offline for {source!r}")
    disaggregated = loop == "ppo" and args.grid.gpu_placement == "disaggregated"
    W = world_size - (args.grid.rollout_ranks if disaggregated else 0)  # train ranks: the fake backend plays 1..W-1
    fakecuda.stand_ins()
    tdist.init_process_group("cpu:fake,cuda:fake", rank=0, world_size=W, store=FakeStore())
    world = dist.World(0, W, 0, torch.device("cuda", 0))
    dist.device_mesh("cuda", W)  # outside fake mode, which cannot build one
    name = os.path.basename(os.path.dirname(source)) if source.endswith("config.json") else args.model.path
    batch, step = (_grpo_batch, _grpo) if loop == "grpo" else (_ppo_chunks, _ppo)
    data = batch(args, world)  # on the host with real numbers, before fake mode
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), fakecuda.flash_attention():
            peak, reads = step(args, world, plan.transformers_config(hf), data, module)
    except FakeTensorDeviceMismatchError as e:
        where = _minirl_frame(e)
        print(f"rehearsal {loop} {name} world {W}: device mismatch in {e.func}: {e.common_device} meets {e.device}"
              f" at {where}; device mismatches 1 (the first stops the rehearsal)", flush=True)
        raise SystemExit(1) from None
    tdist.destroy_process_group()
    lines = _report(loop, name, W, peak, reads, args, world_size, hf, source, disaggregated)
    print("\n".join(lines), flush=True)
    return lines


def _grpo_batch(args, world):
    """This rank's first mini-batch in a RolloutStore, planned as grpo.train plans it."""
    from minirl.batch import RolloutStore, computed_tokens, pack, plan_chunks
    rows, micro = args.mini_batch // world.world_size, args.micro_batch // world.world_size
    # the first micro-batch packs two short rows; the later ones, full length, meet the gradients already
    # resident: the step's peak
    short = {0, 1} if 2 <= micro < rows else set()
    batch = pack(_samples(rows, short, args), torch.ones(rows), 0)
    chunks = plan_chunks(batch["lengths"].tolist(), 1, micro, args.rl.max_tokens_per_micro_batch,
                         computed_tokens if args.model.packing else None)
    return RolloutStore(batch, chunks, reads_per_chunk=1 + args.needs_cached_old_logprobs, device=world.device)


def _grpo(args, world, cfg, store, grpo):
    """One optimizer step of GRPO's update (`grpo`: the loop's module) on the store's mini-batch, inside
    the hand-off."""
    from minirl import models
    from minirl.accumulator import Accumulator, across_ranks, lr_schedule, roll_up
    rl, dtype = args.rl, models.DTYPES[args.model.dtype]
    policy = _build(cfg, "policy", world, args)
    ref = _build(cfg, "reference", world, args) if rl.kl_coef else None
    optimizer = models.adamw(policy, rl.lr, rl.weight_decay)
    _warm(policy, optimizer)
    acc = Accumulator(policy, optimizer, args.n_micro, rl.max_grad_norm, schedule=lr_schedule(rl.lr, 0, 1))
    probe = grpo.Probe(policy, done=True)  # its one-off forward at a run's first step is not the steady state
    handoff = grpo.hand_off(_Engine(), policy, optimizer, ref, args)
    handoff.start_fresh()
    one_epoch = dataclasses.replace(args, rl=dataclasses.replace(rl, mu_iterations=1))
    with _Tracker([(policy, optimizer), (ref, None)]) as tracker:
        handoff.to_trainer()
        before = fakecuda.HOST_READS[0]
        calls, steps = grpo.update(policy, ref, acc, store, one_epoch, probe, args.needs_cached_old_logprobs)
        across_ranks(roll_up(calls)), roll_up(steps)  # the step's metrics, as grpo.train reads them
        reads = fakecuda.HOST_READS[0] - before
        handoff.save_in_update_window(lambda: _save_and_export({"policy": (policy, optimizer)}, dtype))
        handoff.publish()  # the weight-sync gather at the real shape, then the trainer's offload
    store.close()
    return tracker.peak(), reads


def _ppo_chunks(args, world) -> list[dict]:
    """The step's chunks for this rank, as ppo.train hands them to the pump (`batch.group_rows`)."""
    from minirl.batch import group_rows
    p = args.ppo
    per_chunk = args.async_rl.min_groups_for_streaming_train if args.streaming else p.num_prompts_per_step
    n, mine = -(-p.num_prompts_per_step // per_chunk), max(1, per_chunk // world.world_size)
    return [{**group_rows(_groups(mine, p.num_generations_per_prompt, args, first=k == 0 < n - 1), 0),
             "groups": per_chunk} for k in range(n)]


def _ppo(args, world, cfg, chunks, ppo):
    """One PPO step through the real TrainPump (`ppo`: the loop's module): every chunk of the step, then
    the close."""
    from minirl import dist, models, refit
    from minirl.accumulator import Accumulator, across_ranks, lr_schedule
    from minirl.placement import EngineGroups
    from minirl.stream import TrainPump
    p, dtype = args.ppo, models.DTYPES[args.model.dtype]
    policy, value = _build(cfg, "policy", world, args), _build(cfg, "value", world, args)
    ref = _build(cfg, "reference", world, args) if p.kl_coef else None
    policy_opt = models.adamw(policy, p.lr, p.weight_decay)
    value_opt = models.adamw(value, p.value_lr, p.weight_decay)
    _warm(policy, policy_opt)
    _warm(value, value_opt)
    offload, resident = ppo.offloaders(policy, policy_opt, value, value_opt, ref)
    colocated = args.grid.gpu_placement == "colocated"
    if colocated:  # the real EngineGroups hand-off, around an engine that is not there
        source = EngineGroups(args, world, _Engine, None, None)
        source.start(0, policy, resident)
        publish = lambda: source.refit(1, policy)  # noqa: E731
    else:
        wire = _Wire(world.device)
        publish = lambda: refit.send(wire, refit.manifest(policy, dtype), dist.full_parameters(policy, dtype))  # noqa: E731
    acc = Accumulator(policy, policy_opt, n_micro=None, max_grad_norm=p.max_grad_norm, schedule=lr_schedule(p.lr, 0, 1))
    with _Tracker([(policy, policy_opt), (value, value_opt), (ref, None)]) as tracker:
        if colocated:
            source.handoff.to_trainer()
        pump = TrainPump(policy, value, acc, value_opt, ppo.pump_config(args, 0, colocated), 0, refit=publish,
                         ref=ref, log=lambda line: None, policy_off=offload[0], value_off=offload[1],
                         device=world.device, value_schedule=lr_schedule(p.value_lr, 0, 1))
        before = fakecuda.HOST_READS[0]
        for c in chunks:
            pump.chunk(c)
        across_ranks(pump.close())  # the step's metrics, as ppo.train reads them
        reads = fakecuda.HOST_READS[0] - before
        for o in offload:  # ppo.train's save(): both models resident between steps
            o.onload()
        _save_and_export({"policy": (policy, policy_opt), "value": (value, value_opt)}, dtype)
    return tracker.peak(), reads


def _save_and_export(parts: dict, dtype: torch.dtype) -> None:
    """What a checkpoint and the export do on the card, without the writes (a fake tensor has no bytes): the
    finiteness check, DCP's sharded state dicts, the export's gather of every full parameter."""
    from minirl import checkpoint
    from minirl.run import export_hf
    checkpoint.require_finite({name: model for name, (model, _) in parts.items()})
    checkpoint.state_dicts(parts)
    export_hf(parts["policy"][0], "", "", False, dtype)


# ---- the rehearsal's batch, models and world ----

def _tokens(n: int) -> list[int]:
    return [(7 * i + 3) % 1000 + 1 for i in range(max(1, n))]


def _samples(rows: int, short: set, args):
    """`rows` samples of the full prompt and completion lengths, but for the rows in `short`: half as
    long, so two of them pack into one lane and the padding-free path runs too."""
    from minirl.rollout import Samples
    Tp, Tc = args.rollout.max_prompt_tokens, args.rollout.max_tokens
    prompts = [_tokens(Tp // 2 if r in short else Tp) for r in range(rows)]
    comps = [_tokens(Tc // 2 if r in short else Tc) for r in range(rows)]
    return Samples(list(range(rows)), prompts, comps, [[-1.0] * len(c) for c in comps], ["length"] * rows)


def _groups(count: int, G: int, args, first: bool) -> list[dict]:
    """`count` groups of G samples, as the rollout hands them over (`batch.as_group`); in the first of
    several chunks the first two groups are half as long (packed together)."""
    from minirl.batch import as_group
    half = lambda g: first and g < 2 <= count  # noqa: E731
    return [as_group(_samples(G, set(range(G)) if half(g) else set(), args), slice(0, G), [1.0] * G, [[1.0] * G], 0)
            for g in range(count)]


def _build(cfg, kind: str, world, args):
    """A model as models.sharded builds it, from its config alone: on the meta device, sharded, then given
    (fake) storage on the card, with a Qwen2/Llama's load-check verdicts."""
    from transformers import AutoModel, AutoModelForCausalLM

    from minirl import models
    dtype = models.DTYPES[args.model.dtype]
    cfg.use_cache = False  # no KV cache in training, as models.load_* set it
    with torch.device("meta"):
        if kind == "value":
            backbone = AutoModel.from_config(cfg, dtype=torch.float32)
            model = models.ValueModel(backbone, cfg.hidden_size)
        else:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if kind == "policy" else dtype)
    if kind == "reference":
        model.eval().requires_grad_(False)
    model.pack_rows, model.chunked_head = args.model.packing, True
    models.shard_built(model, kind, world, args.model.dtype, args.model.activation_checkpointing)
    return model.to_empty(device=world.device)


def _warm(model, optimizer) -> None:
    """AdamW's moments exist from a run's first step on: create them with one zero-gradient step."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _Engine:
    """The colocated engine's place in the hand-off: sleeps and wakes, and takes the weight sync."""

    def sleep(self, level: int = 1) -> None:
        pass

    def wake_up(self, tags=None) -> None:
        pass

    def load_weights(self, named) -> None:
        for _ in named:  # one gathered parameter at a time, as the engine copies them in
            pass


class _Wire:
    """The refit group's place: a broadcast that is done at once."""

    def __init__(self, device: torch.device):
        self.device = device

    def broadcast(self, t: torch.Tensor, src: int = 0):
        return self

    def wait(self) -> None:
        pass


# ---- measuring ----

class _Tracker(FSDPMemTracker):
    """FSDPMemTracker over several FSDP2 models and their optimizers at once, that takes a root's
    forward per micro-batch (it refuses a second), and whose peak skips optimizer.step()'s inside."""

    def __init__(self, pairs):
        self.pairs = [(m, o) for m, o in pairs if m is not None]
        self.shapes_only = 0
        super().__init__(self.pairs[0][0], self.pairs[0][1])

    def __enter__(self):
        """DTensor's sharding propagation reruns ops on fake tensors of the GLOBAL shape to learn metadata:
        not allocations, so not counted."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        self.propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def shapes_only(prop, *a, **k):
            self.shapes_only += 1
            try:
                return self.propagate(prop, *a, **k)
            finally:
                self.shapes_only -= 1
        ShardingPropagator._propagate_tensor_meta_non_cached = shapes_only
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        ShardingPropagator._propagate_tensor_meta_non_cached = self.propagate
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.shapes_only:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _register_module_and_optimizer_hooks(self) -> None:
        handles = []
        for model, optimizer in self.pairs:
            self._root_mod, self._optm, self._optimizer_hook_handles = model, optimizer, None
            self._instrument_fsdp_module()
            self._instrument_optimizer()
            handles += self._optimizer_hook_handles or ()
        self._optimizer_hook_handles = tuple(handles) or None

    def _fsdp_state_pre_forward(self, fsdp_mod, orig):
        inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)
        roots = [m for m, _ in self.pairs]

        def again(*a, **k):
            if any(fsdp_mod is r for r in roots) and not self._mod_tracker.is_bw:
                self.memory_tracking.pop(fsdp_mod, None)  # a new module record; the run's peak stays
            return inner(*a, **k)
        return again

    def _update_peak_stats(self, peak_state) -> None:
        """The run's peak only (no per-module peaks: a walk over every module's record per op)."""
        if self._in_opt:
            return
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev], self._peak_mem_snap[dev] = snap["Total"], dict(snap)

    def peak(self) -> dict[str, float]:
        snap = next((s for d, s in self.get_tracker_snapshot("peak").items() if d.type == "cuda"), {})
        g = {k: v / GIB for k, v in snap.items()}
        return {"params": g.get("Sharded Param", 0) + g.get("Unsharded Param", 0) + g.get("Buffer", 0),
                "grads": g.get("Sharded Grad", 0) + g.get("Unsharded Grad", 0),
                "optimizer": g.get("OptState", 0), "activations": g.get("Activation", 0),
                "temporaries": g.get("Temp", 0) + g.get("All Gather", 0) + g.get("Reduce Scatter", 0)
                + g.get("Inputs", 0)}


def _minirl_frame(e: BaseException) -> str:
    """The innermost line of minirl's own code in `e`'s traceback (the tools' own frames aside)."""
    tools = os.path.dirname(os.path.abspath(__file__))
    here = os.path.dirname(tools)  # the package
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename).startswith(here + os.sep)
              and not os.path.abspath(f.filename).startswith(tools + os.sep)]
    f = frames[-1] if frames else traceback.extract_tb(e.__traceback__)[-1]
    return f"{os.path.relpath(f.filename, os.path.dirname(here))}:{f.lineno} ({f.name}: {f.line})"


def _report(loop, name, W, peak, reads, args, world_size, hf, source, disaggregated) -> list[str]:
    from minirl.tools import plan
    estimate = plan.train_rank_terms(args, world_size, hf)
    trainer, planned = sum(peak.values()), sum(estimate.values())
    role = "train" if disaggregated else "both"
    card = plan.card_peak(args, role, trainer, publish=plan.publish_gib(args, hf, estimate) if role == "both" else 0)
    fits = "fits" if card <= args.dry_run_card_gib else "DOES NOT FIT"
    show = lambda d: " ".join(f"{k} {v:.2f}" for k, v in d.items())  # noqa: E731
    share = f"engine {plan.engine_gib(args, role):.1f}, " if role == "both" else ""
    return [f"rehearsal {loop} {name} world {W}: rehearsed GiB per card: {show(peak)}",
            f"rehearsal {loop} {name} world {W}: plan GiB per card: {show(estimate)}",
            f"rehearsal {loop} {name} world {W}: card peak {card:.1f} of {args.dry_run_card_gib:g} GiB "
            f"({share}trainer {trainer:.1f}, context {plan.BASELINE_GIB:g}): {fits}",
            f"rehearsal {loop} {name} world {W}: peak {trainer:.2f} GiB per card, plan {planned:.2f} GiB, "
            f"host reads per {'optimizer step' if loop == 'grpo' else 'step'} {reads}, "
            f"device mismatches 0 ({planned / trainer - 1:+.0%} plan vs rehearsal; {fits})"]
