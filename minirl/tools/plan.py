"""The launch plan, before a GPU is touched: `--dry-run` on both entrypoints.

    python -m minirl.ppo --dry-run --dry-run-world-size 8 --dry-run-device cuda --grid.rollout-ranks 2 ...

validates the flags for the world they describe and prints one line per rank (its node, role, devices
from `dist.device_map`, its share of the batch, and a memory estimate with a fits / DOES NOT FIT
verdict and, if it does not, the largest micro-batch that would), without loading weights, building an
engine or joining a process group. The estimate is arithmetic on the model's config.json and its
parameters as transformers builds them (on the meta device: any family's layout): float32
master shards, gathered compute-dtype blocks, the reference, gradients, AdamW's moments, the saved
activations (what the model's own blocks save for backward, run on fake tensors, or with activation
checkpointing their inputs), one piece of the chunked logprob
head, the engine's `--rollout.gpu-memory-utilization`, and 1 GiB of CUDA context. Colocated, engine and
trainer take turns but for the publish. It is meant to catch a recipe that cannot fit; `--rehearse`
measures the step itself (docs/gpu.md compares the two).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import weakref

import torch

from minirl import dist, models, rewards
from minirl.config import TINY, ConfigError, hub_name
from minirl.config_grpo import GRPOArgs
from minirl.config_ppo import PPOArgs
from minirl.rollout import check_model, check_trainable, with_sizes

GIB = 2**30
BASELINE_GIB = 1.0  # CUDA context, NCCL communicators, allocator slack


def dry_run(args: GRPOArgs | PPOArgs) -> list[str]:
    """Validate `args` for the world the flags name (the plug-in rewards imported too) and return (and
    print, on rank 0) the plan."""
    world = args.dry_run_world_size or int(os.environ.get("WORLD_SIZE", 1))
    device_type = args.dry_run_device or ("cuda" if args.rehearse else dist.device_type())
    args.validate(world)
    rewards.scorer(args.task)
    hf, source = model_config(args.model)
    if hf is not None:
        check_model(source, args.rollout, args.rollout.max_model_len, device_type=device_type, hf=hf)
        check_trainable(hf)
    lines = plan(args, world, device_type, hf, source)
    if int(os.environ.get("RANK", 0)) == 0:
        print("\n".join(lines), flush=True)
    return lines


def model_config(cfg) -> tuple[dict | None, str]:
    """The model's config.json without loading it or touching the network: (config or None, where)."""
    if cfg.path == TINY:
        t = cfg.tiny
        from minirl.models import ALPHABET, SPECIALS
        return {"model_type": "qwen2", "vocab_size": len(SPECIALS) + len(ALPHABET), "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_layers,
                "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
                "max_position_embeddings": t.max_positions, "tie_word_embeddings": True}, "the built-in tiny model"
    found = os.path.join(cfg.path, "config.json") if os.path.isdir(cfg.path) else None
    if found is None and hub_name(cfg.path):
        try:
            from huggingface_hub import try_to_load_from_cache
            hit = try_to_load_from_cache(cfg.path, "config.json")  # local cache only, no network
            found = hit if isinstance(hit, str) else None
        except Exception:
            found = None
    if found is None or not os.path.isfile(found):
        if not os.path.isdir(cfg.path) and not hub_name(cfg.path):
            raise ConfigError(f"--model.path={cfg.path!r} does not exist; give a local model folder, a hub name, "
                              f"or `{TINY}`")
        return None, cfg.path
    with open(found) as f:
        return with_sizes(json.load(f)), found


def parameter_counts(hf: dict) -> dict[str, int]:
    """Parameters of the model as transformers builds it (any family): the root (embedding, final norm, an
    untied head), the largest block (FSDP2 gathers a block whole: DeepSeek's mixtures of experts, not its
    dense first blocks), all."""
    blocks, total = _counted(json.dumps(hf, sort_keys=True))
    return {"root": total - sum(blocks), "block": max(blocks), "total": total}


@functools.lru_cache
def _counted(config: str) -> tuple[tuple[int, ...], int]:
    """(each block's parameters, all) of a config.json, built on the meta device: no memory, 0.3 s for 70B."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(json.loads(config)))
    blocks = tuple(sum(p.numel() for p in block.parameters()) for block in dist.decoder_blocks(model))
    return blocks, sum(p.numel() for p in model.parameters())


def transformers_config(hf: dict):
    """transformers' config of a config.json as `with_sizes` read it (the plan's and the rehearsal's models),
    less the sizes it named that the family computes (Falcon's head_dim is a property: setting it fails)."""
    from transformers import CONFIG_MAPPING, AutoConfig
    cls = CONFIG_MAPPING[hf["model_type"]]
    computed = {k for k in hf if isinstance(getattr(cls, k, None), property) and getattr(cls, k).fset is None}
    return AutoConfig.for_model(**{k: v for k, v in hf.items() if k not in computed})


@functools.lru_cache
def saved_per_token(config: str, dtype: str, row: int) -> tuple[float, float]:
    """Bytes the decoder blocks keep for backward per token of a `row`-token sequence, all of them and the
    largest block's, counted from what autograd saves as the model's own blocks (transformers' class for
    config.json) run on fake tensors: no memory, no values computed, and any family's norms, MLP,
    activation function, attention kernel (an eager one's (row, row) weights included) and mix of blocks
    (DeepSeek's dense first blocks, a hybrid's linear-attention ones). Each storage the graph still holds
    when the forward ends counts once, in the block that saved it first: a block's input and what it
    creates, not the parameters or what a block is handed (the rotary tables). The blocks run in eval()
    (no dropout, as the trainer's dropout 0.0) without the causal mask, which on fake tensors transformers
    would build in full and pass to the kernel (on real ones it passes none). A layer whose fast kernel runs
    only on a GPU (Mamba's, flash-linear-attention's) is counted as its torch path. Blocks that fake tensors
    cannot run (a step that reads a value: JetMoE's routing) are counted as Qwen2 blocks of their widths:
    8h + 2kv + 4i values in the compute dtype and 2h in float32 each, what a real Qwen2 block keeps with
    about two hidden-size vectors to spare. A row over 512 tokens is not run: the bytes per token are a
    line in the row's length (an eager kernel's weights grow with it; a few fixed-size tensors stray from
    it by 0.1%), drawn through 256 and 512 tokens, so a layer that loops over the tokens in Python
    (Mamba's torch path) takes seconds, not minutes."""
    if row > 512:
        short, long = saved_per_token(config, dtype, 256), saved_per_token(config, dtype, 512)
        return tuple(a + (b - a) * (row - 256) / 256 for a, b in zip(short, long))
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM
    kept, skip, runs, inside = [], set(), [], []  # kept: (what autograd holds, weakly; the block run saving it)

    def enter(block, args, kwargs):  # a forward pre-hook: the block's arguments
        bound = inspect.signature(block.forward).bind(*args, **kwargs)
        if "attention_mask" in bound.arguments:
            bound.arguments["attention_mask"] = None
        _, *handed = [t for v in bound.arguments.values() for t in (v if isinstance(v, tuple) else (v,))]
        skip.update(t.untyped_storage()._cdata for t in handed if isinstance(t, torch.Tensor))
        runs.append(block)
        inside.append(block)
        return bound.args, bound.kwargs

    def keep(t: torch.Tensor) -> torch.Tensor:
        if inside:
            kept.append((weakref.ref(t), len(runs) - 1))
        return t

    try:
        with FakeTensorMode():
            hf = transformers_config(json.loads(config))
            model = AutoModelForCausalLM.from_config(hf, dtype=models.DTYPES[dtype]).eval()
            skip.update(t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()])
            for block in dist.decoder_blocks(model):
                block.register_forward_pre_hook(enter, with_kwargs=True)
                block.register_forward_hook(lambda *_: inside.clear())
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out = model(input_ids=torch.zeros(1, row, dtype=torch.long), use_cache=False)  # fake, host kernels
    except Exception:  # fake tensors cannot give the value the step reads
        d, c = json.loads(config), models.DTYPES[dtype].itemsize
        h, i, heads = d["hidden_size"], d["intermediate_size"], d["num_attention_heads"]
        kv = d.get("num_key_value_heads", heads) * (d.get("head_dim") or h // heads)
        block = c * (8 * h + 2 * kv + 4 * i) + 4 * 2 * h
        return d["num_hidden_layers"] * block, block
    first = {}  # each storage the graph still holds (a dropped node's are freed), by the first block saving it
    for ref, k in kept:
        if (t := ref()) is not None and t.untyped_storage()._cdata not in skip:
            first.setdefault(t.untyped_storage()._cdata, (k, t.untyped_storage().nbytes()))
    del out  # held until here: the graph, and what it keeps
    sizes = [0.0] * len(runs)
    for k, n in first.values():
        sizes[k] += n / row
    return sum(sizes), max(sizes)


def plan(args, world: int, device_type: str, hf: dict | None, source: str) -> list[str]:
    grpo = isinstance(args, GRPOArgs)
    placement = "colocated" if grpo else args.grid.gpu_placement
    R = 0 if placement == "colocated" else args.grid.rollout_ranks
    compute = args.model.dtype
    T = args.rollout.max_model_len
    head = [f"plan: {'minirl.grpo' if grpo else 'minirl.ppo'}, {world} rank(s) on {device_type}, {placement}; "
            f"model {source}" + (f" ({parameter_counts(hf)['total'] / 1e9:.2f}B parameters)" if hf else "")]
    lines = []
    per_node = ranks_per_node(args, world)
    nnodes = world // per_node
    if nnodes > 1:
        head.append(f"plan: {nnodes} nodes x {per_node} ranks; a rank's card is its index on its node")
    for g in range(world):
        node, local = divmod(g, per_node)  # torchrun numbers ranks node by node
        d = dist.device_map(g, local, world, R, placement, device_type)
        role = "both" if d.trainer and d.engine else ("train" if d.trainer else "rollout")
        params = "float32" if d.trainer else compute
        where = f" node={node}" if nnodes > 1 else ""
        prefix = (f"rank {g}:{where} role={role} trainer={d.trainer or '-'} engine={d.engine or '-'} "
                  f"params={params} compute={compute}")
        share, mem = (_grpo_share(args, world, hf, T) if grpo else _ppo_share(args, g, world, R, role, hf, T))
        memory = _memory(args, role, mem, device_type, hf)
        if memory.endswith("(DOES NOT FIT)") and role != "rollout":
            memory += f"; {suggest(args, world, hf, role)}"
        lines.append(f"{prefix} | {share} | {memory}")
    return head + lines


def suggest(args, world: int, hf: dict, role: str) -> str:
    """For a train rank that does not fit: the largest micro-batch that does (with activation
    checkpointing if it needs it), as the flags to pass."""
    import dataclasses
    grpo = isinstance(args, GRPOArgs)
    dp = world if grpo else world - (args.grid.rollout_ranks if role == "train" else 0)
    rows = args.mini_batch // dp if grpo else args.ppo.num_prompts_per_step * args.ppo.num_generations_per_prompt // dp
    for checkpointing in sorted({args.model.activation_checkpointing, True}):
        model = dataclasses.replace(args.model, activation_checkpointing=checkpointing)
        for m in range(rows, 0, -1):
            if grpo and rows % m:
                continue  # micro-batches split a mini-batch evenly
            if grpo:
                tried = dataclasses.replace(args, model=model, rl=dataclasses.replace(
                    args.rl, micro_batch_per_replica=m * dp, max_tokens_per_micro_batch=0))
                flags = f"--rl.micro-batch-per-replica {m * dp}"
            else:
                tried = dataclasses.replace(args, model=model, ppo=dataclasses.replace(
                    args.ppo, policy_micro_batch_rows=m, critic_micro_batch_rows=m))
                flags = f"--ppo.policy-micro-batch-rows {m} --ppo.critic-micro-batch-rows {m}"
            terms = train_rank_terms(tried, world, hf)
            peak = card_peak(tried, role, sum(terms.values()), publish=publish_gib(tried, hf, terms))
            if peak <= args.dry_run_card_gib:
                ac = " --model.activation-checkpointing" if checkpointing and not args.model.activation_checkpointing \
                    else ""
                return f"fits with {flags}{ac} (peak {peak:.1f})"
    return "no micro-batch fits: more ranks (--dry-run-world-size), shorter sequences, or a bigger card"


def ranks_per_node(args, world: int) -> int:
    """Ranks on one node: the world over --dry-run-nnodes, or torchrun's LOCAL_WORLD_SIZE when this
    process belongs to the launch being planned."""
    if args.dry_run_nnodes > 1:
        if world % args.dry_run_nnodes:
            raise ConfigError(f"--dry-run-world-size={world} is not a multiple of --dry-run-nnodes="
                              f"{args.dry_run_nnodes} (torchrun starts the same --nproc-per-node on every node)")
        return world // args.dry_run_nnodes
    inside = int(os.environ.get("WORLD_SIZE", 0)) == world and "LOCAL_WORLD_SIZE" in os.environ
    return int(os.environ["LOCAL_WORLD_SIZE"]) if inside else world


def activation_bytes(hf: dict, dtype: str, tokens: int, row: int, checkpointing: bool) -> float:
    """What a micro-batch of `tokens` in rows of up to `row` keeps for backward: every block's saved
    tensors, or, with --model.activation-checkpointing, every block's input plus the largest block's
    tensors while it reruns."""
    L, c = hf["num_hidden_layers"], models.DTYPES[dtype].itemsize
    every, largest = saved_per_token(json.dumps(hf, sort_keys=True), dtype, min(row, tokens))
    return tokens * (L * c * hf["hidden_size"] + largest if checkpointing else every)


def _trainer_terms(hf: dict, dp: int, dtype: str, micro_tokens: int, row: int, ref: bool,
                   checkpointing: bool) -> dict[str, float]:
    """One trained model's terms (GiB): its float32 master shard with the root and its two largest blocks
    gathered in the compute dtype (and the reference's shard and gather), float32 gradients, AdamW's two
    moments, one micro-batch's activations, one piece of the chunked head."""
    n, V, c = parameter_counts(hf), hf["vocab_size"], models.DTYPES[dtype].itemsize
    gathered = c * (n["root"] + 2 * n["block"])
    piece = min(micro_tokens, max(1, models.LOGITS_CHUNK // V))
    summed = 4 * V * hf["hidden_size"] if c < 4 else 0  # the head's weight gradient, summed in float32
    return {"params": (4 * n["total"] / dp + gathered + (c * n["total"] / dp + gathered if ref else 0)) / GIB,
            "grads": 4 * n["total"] / dp / GIB,
            "optimizer": 8 * n["total"] / dp / GIB,
            "activations": activation_bytes(hf, dtype, micro_tokens, row, checkpointing) / GIB,
            "logits": (piece * V * (c + 4 + 4) + summed) / GIB}


def _grpo_share(args: GRPOArgs, dp: int, hf, T: int):
    rl = args.rl
    rows = rl.batch_per_replica // dp
    micro_rows = args.micro_batch // dp
    n_micro = "budget" if rl.max_tokens_per_micro_batch else str(args.n_micro)
    micro_tokens = rl.max_tokens_per_micro_batch or micro_rows * T
    share = (f"prompts={rows // rl.group_size} rows={rows} n_mini={args.n_mini} n_micro={n_micro} "
             f"micro_rows={micro_rows if not rl.max_tokens_per_micro_batch else '-'} tokens<={T}")
    terms = _trainer_terms(hf, dp, args.model.dtype, micro_tokens, T, ref=bool(rl.kl_coef),
                           checkpointing=args.model.activation_checkpointing) if hf else None
    return share, terms


def _ppo_share(args: PPOArgs, g: int, world: int, R: int, role: str, hf, T: int):
    p, c = args.ppo, models.DTYPES[args.model.dtype].itemsize
    G = p.num_generations_per_prompt
    if role == "rollout":
        prompts = len(range(g, p.num_prompts_per_step, R))
        return f"prompts={prompts} rows={prompts * G} (generates)", ({} if hf else None)
    dp = world - R
    rows = p.num_prompts_per_step * G // dp
    micro = p.policy_micro_batch_rows or rows
    critic = p.critic_micro_batch_rows or rows
    share = (f"prompts={p.num_prompts_per_step // dp} rows={rows} n_mini=1 n_micro={math.ceil(rows / micro)} "
             f"epochs={p.ppo_epochs} critic_rows={critic} tokens<={T}")
    if not hf:
        return share, None
    # training: one model resident at a time, the pump offloads the idle one with its optimizer (S7),
    # and the policy's kept gradients are freed by its step before the critic trains; a checkpoint or
    # the export: both models and both optimizers resident, no gradients, no activations
    train = _trainer_terms(hf, dp, args.model.dtype, max(micro, critic) * T, T, ref=bool(p.kl_coef),
                           checkpointing=args.model.activation_checkpointing)
    n = parameter_counts(hf)
    save = {"params": (2 * 4 * n["total"] / dp + (c * n["total"] / dp if p.kl_coef else 0)
                       + c * hf["vocab_size"] * hf["hidden_size"]) / GIB,  # + the export's largest gathered one
            "grads": 0.0, "optimizer": 2 * 8 * n["total"] / dp / GIB, "activations": 0.0, "logits": 0.0}
    terms = max(train, save, key=lambda t: sum(t.values()))
    return share, terms


def train_rank_terms(args: GRPOArgs | PPOArgs, world: int, hf: dict) -> dict[str, float]:
    """The memory terms (GiB) of one train rank of a launch of `world` ranks (what --rehearse measures)."""
    T = args.rollout.max_model_len
    if isinstance(args, GRPOArgs):
        return _grpo_share(args, world, hf, T)[1]
    R = args.grid.rollout_ranks if args.grid.gpu_placement == "disaggregated" else 0
    return _ppo_share(args, R, world, R, "train" if R else "both", hf, T)[1]


def engine_gib(args, role: str, device_type: str = "cuda") -> float:
    """The engine's share of a rank's card: vLLM's --rollout.gpu-memory-utilization cap (host: its KV cache)."""
    if role not in ("rollout", "both"):
        return 0.0
    return args.rollout.gpu_memory_utilization * args.dry_run_card_gib if device_type == "cuda" \
        else args.rollout.kv_cache_gib


def publish_gib(args, hf: dict, terms: dict) -> float:
    """A colocated publish (GiB): the engine's weights wake while the trainer's parameters and optimizer
    state are still on the card."""
    weights = parameter_counts(hf)["total"] * models.DTYPES[args.model.dtype].itemsize / GIB
    return weights + terms["params"] + terms["optimizer"]


def card_peak(args, role: str, trainer: float, publish: float, device_type: str = "cuda") -> float:
    """A rank's peak (GiB): a colocated card's engine and trainer take turns but for the publish; else they
    add up; plus the CUDA context."""
    engine = engine_gib(args, role, device_type)
    handoff = args.rl.colocated_offload if isinstance(args, GRPOArgs) else args.ppo.colocated_offload
    return (max(engine, trainer, publish) if role == "both" and handoff else engine + trainer) + BASELINE_GIB


def _memory(args, role: str, terms: dict | None, device_type: str, hf: dict | None) -> str:
    if terms is None:
        return "memory: unknown (no config.json readable offline; pass a local model folder)"
    card = args.dry_run_card_gib
    shown = " ".join(f"{k} {v:.2f}" for k, v in {**terms, "engine": engine_gib(args, role, device_type)}.items())
    publish = publish_gib(args, hf, terms) if role == "both" else 0.0
    if publish:
        shown += f" publish {publish:.2f}"
    peak = card_peak(args, role, sum(terms.values()), publish, device_type)
    if device_type != "cuda":
        return f"memory GiB: {shown} | peak {peak:.1f} (host memory)"
    verdict = "fits" if peak <= card else "DOES NOT FIT"
    return f"memory GiB: {shown} | peak {peak:.1f} of {card:g} ({verdict})"
