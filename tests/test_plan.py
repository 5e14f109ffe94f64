"""tools/plan.py: `--dry-run` shows every rank's role, devices, share and memory before a GPU is touched.
The GPU recipes are planned at their world size on CUDA from the recipe models' config.json files
(tests/data/models: configs only, no weights)."""

import json
import math
import os
import re
import sys

import pytest
import tyro

from conftest import ROOT, run
from minirl.tools import plan
from minirl.config_grpo import GRPOArgs
from minirl.config_ppo import PPOArgs
from test_recipes import RECIPES, flags

MODELS = os.path.join(ROOT, "tests", "data", "models")
LINE = re.compile(r"rank (\d+): (?:node=\d+ )?role=(rollout|train|both) trainer=(\S+) engine=(\S+) params=(\w+) "
                  r"compute=(\w+) \| (.*) \| (.*)")
GPU_RECIPES = [r for r in RECIPES if "gsm8k" in os.path.basename(r)]


def recipe_args(path, tmp_path):
    module, nproc, argv, nnodes = flags(path)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "q", "answer": "1"}\n' * 10)
    argv = [str(data) if a.endswith(".jsonl") else a for a in argv]
    i = argv.index("--model.path")
    argv[i + 1] = os.path.join(MODELS, os.path.basename(argv[i + 1]))  # Qwen/X -> tests/data/models/X
    cls = {"minirl.grpo": GRPOArgs, "minirl.ppo": PPOArgs}[module]
    args = tyro.cli(cls, args=argv + ["--dry-run", "--dry-run-world-size", str(nproc), "--dry-run-nnodes", str(nnodes),
                                      "--dry-run-device", "cuda"])
    return args, nproc


@pytest.mark.parametrize("path", GPU_RECIPES, ids=os.path.basename)
def test_every_gpu_recipe_plans_its_devices_and_fits_an_80_gib_card(path, tmp_path):
    args, nproc = recipe_args(path, tmp_path)
    lines = plan.dry_run(args)
    ranks = [LINE.fullmatch(line) for line in lines if line.startswith("rank ")]
    assert len(ranks) == nproc and all(ranks), lines
    assert "unknown" not in "\n".join(lines)
    node = lambda m: int(m.group(1)) // (nproc // args.dry_run_nnodes)  # noqa: E731  (ranks go node by node)
    engines = [(node(m), m.group(4)) for m in ranks if m.group(4) != "-"]
    trainers = [(node(m), m.group(3)) for m in ranks if m.group(3) != "-"]
    if isinstance(args, PPOArgs) and args.grid.gpu_placement == "disaggregated":
        assert len(set(engines)) == len(engines) == args.grid.rollout_ranks
        assert not set(engines) & set(trainers)
    else:
        assert all(m.group(2) == "both" and m.group(3) == m.group(4) == f"cuda:{m.group(1)}" for m in ranks)
    assert all(m.group(5) == "float32" for m in ranks if m.group(2) != "rollout")  # master weights
    assert all(m.group(6) == "bfloat16" for m in ranks)
    for m in ranks:
        peak = float(re.search(r"peak ([\d.]+) of 80 \(fits\)", m.group(8)).group(1))
        assert 1.0 < peak <= 80.0, m.group(0)


def test_two_nodes_number_cards_per_node(tmp_path):
    """`--dry-run-nnodes 2`: ranks are numbered node by node and a card is a rank's index on its node,
    so 2 nodes of 8 use cuda:0..7 on each (the old plan printed cuda:8..15 for node 1)."""
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_ppo_8gpu.sh"), tmp_path)
    args.dry_run_world_size, args.dry_run_nnodes, args.grid.rollout_ranks = 16, 2, 4  # 252 prompts / 12
    lines = plan.dry_run(args)
    ranks = [re.match(r"rank (\d+): node=(\d) role=(\w+) trainer=(\S+) engine=(\S+)", line)
             for line in lines if line.startswith("rank ")]
    assert len(ranks) == 16 and all(ranks), lines
    for m in ranks:
        g, node, role = int(m.group(1)), int(m.group(2)), m.group(3)
        assert node == g // 8 and role == ("rollout" if g < 4 else "train")
        assert m.group(5 if role == "rollout" else 4) == f"cuda:{g % 8}"
    args.dry_run_nnodes = 3
    with pytest.raises(Exception, match="--dry-run-nnodes"):
        plan.dry_run(args)


def test_memory_estimate_counts_the_model(tmp_path):
    """0.5B at 16 bytes per parameter (float32 masters, grads, AdamW) on one rank is about 7.3 GiB."""
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_grpo_1gpu.sh"), tmp_path)
    hf, _ = plan.model_config(args.model)
    assert abs(plan.parameter_counts(hf)["total"] / 1e9 - 0.494) < 0.005  # Qwen2.5-0.5B: 494M parameters
    line = [x for x in plan.dry_run(args) if x.startswith("rank 0")][0]
    terms = dict(re.findall(r"(\w+) ([\d.]+)", line.split("memory GiB:")[1].split("|")[0]))
    assert abs(float(terms["grads"]) + float(terms["optimizer"]) - 12 * 494e6 / 2**30) < 0.1
    args.rl.micro_batch_per_replica = 256  # the whole batch in one forward, every block's activations kept:
    args.model.activation_checkpointing = False  # far over a card
    assert "DOES NOT FIT" in plan.dry_run(args)[1]


def test_a_model_without_a_readable_config_gets_memory_unknown(tmp_path):
    args = tyro.cli(PPOArgs, args=["--model.path", "someorg/not-in-the-cache", "--grid.rollout-ranks", "1"])
    args.dry_run_world_size, args.dry_run_device = 2, "cuda"
    lines = plan.dry_run(args)
    assert len(lines) == 3 and all("memory: unknown" in x for x in lines[1:])


def test_dry_run_exits_0_without_loading_or_building(tmp_path):
    """Through the command line: no process group, no weights, no engine (the tiny model is not even built)."""
    cache = tmp_path / "cache"
    p = run([sys.executable, "-m", "minirl.ppo", "--dry-run", "--dry-run-world-size", "8", "--dry-run-device", "cuda",
             "--grid.rollout-ranks", "2", "--ppo.num-prompts-per-step", "12", "--log.run-dir", str(tmp_path / "r")],
            timeout=120, env={"MINIRL_CACHE": str(cache)})
    assert p.returncode == 0
    assert [line.split(" ")[1] for line in p.stdout.splitlines() if line.startswith("rank ")] == \
        [f"{r}:" for r in range(8)]
    assert "rank 1: role=rollout trainer=- engine=cuda:1" in p.stdout
    assert "rank 2: role=train trainer=cuda:2 engine=-" in p.stdout
    assert not cache.exists() and not (tmp_path / "r").exists()
    bad = run([sys.executable, "-m", "minirl.grpo", "--dry-run", "--dry-run-world-size", "3"], timeout=120)
    assert bad.returncode == 2 and "--rl.batch-per-replica" in bad.stderr


def test_a_train_rank_that_does_not_fit_is_told_the_largest_micro_batch_that_does(tmp_path):
    """The PPO recipe without activation checkpointing on 10 GiB cards: its train ranks do not fit at 8
    rows per micro-batch; the plan
    names the largest count that fits, which does (re-planned), and one more row does not; on a card where
    only one row fits, it names one; asked for a train rank's whole share at once, it counts down from that
    share (the train ranks' split, not the world's)."""
    import dataclasses
    args, nproc = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_ppo_8gpu.sh"), tmp_path)
    args.dry_run_card_gib, args.model.activation_checkpointing = 10.0, False
    line = next(x for x in plan.dry_run(args) if x.startswith("rank 2:"))
    hint = re.search(r"\(DOES NOT FIT\); fits with --ppo.policy-micro-batch-rows (\d+) "
                     r"--ppo.critic-micro-batch-rows (\d+) \(peak ([\d.]+)\)$", line)
    assert hint and hint.group(1) == hint.group(2), line
    m = int(hint.group(1))
    assert 1 <= m < 8

    def planned(rows):  # rank 2's line at `rows` per micro-batch
        tried = dataclasses.replace(args, ppo=dataclasses.replace(args.ppo, policy_micro_batch_rows=rows,
                                                                  critic_micro_batch_rows=rows))
        return next(x for x in plan.dry_run(tried) if x.startswith("rank 2:"))

    def peak(rows):
        return float(re.search(r"peak ([\d.]+) of", planned(rows)).group(1))
    assert planned(m).endswith("(fits)") and "(DOES NOT FIT)" in planned(m + 1)
    assert abs(peak(m) - float(hint.group(3))) < 0.05
    args.dry_run_card_gib = (peak(1) + peak(2)) / 2  # only one row per micro-batch fits
    line = next(x for x in plan.dry_run(args) if x.startswith("rank 2:"))
    assert line.endswith(f"--ppo.policy-micro-batch-rows 1 --ppo.critic-micro-batch-rows 1 (peak {peak(1):.1f})")
    # a whole share per micro-batch (0): the count is searched down from the share of one of the 6 train
    # ranks (42 rows; the 2 rollout ranks hold none), and all but one row fits
    rows = args.ppo.num_prompts_per_step * args.ppo.num_generations_per_prompt // (nproc - args.grid.rollout_ranks)
    args.ppo.policy_micro_batch_rows = args.ppo.critic_micro_batch_rows = 0
    args.dry_run_card_gib = (peak(rows - 1) + peak(rows)) / 2
    line = next(x for x in plan.dry_run(args) if x.startswith("rank 2:"))
    assert rows == 42 and f"--ppo.policy-micro-batch-rows {rows - 1} " in line, line


def test_a_colocated_plan_counts_the_publish_where_engine_weights_and_trainer_overlap(tmp_path):
    """The hand-off's publish wakes the engine's weights (compute dtype, whole) while the trainer's shards
    and AdamW state are still resident: at 8 ranks of the 3B GRPO recipe with a small engine share and
    one row per micro-batch, that moment is the card's peak, not the larger of the two phases."""
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_grpo_3b.sh"), tmp_path)
    args.rollout.gpu_memory_utilization, args.rl.micro_batch_per_replica = 0.1, 8
    line = [x for x in plan.dry_run(args) if x.startswith("rank 0")][0]
    terms = dict(re.findall(r"(\w+) ([\d.]+)", line.split("memory GiB:")[1].split("|")[0]))
    hf, _ = plan.model_config(args.model)
    weights = plan.parameter_counts(hf)["total"] * 2 / 2**30  # bf16
    assert float(terms["publish"]) == pytest.approx(weights + float(terms["params"]) + float(terms["optimizer"]),
                                                    abs=0.02)
    trainer = sum(float(terms[k]) for k in ("params", "grads", "optimizer", "activations", "logits"))
    assert float(terms["publish"]) > max(trainer, float(terms["engine"]))
    peak = float(re.search(r"peak ([\d.]+) of", line).group(1))
    assert peak == pytest.approx(float(terms["publish"]) + plan.BASELINE_GIB, abs=0.06)


QWEN2 = dict(vocab_size=100, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("shape", [dict(tie_word_embeddings=True), dict(tie_word_embeddings=False), dict(),
                                   dict(num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)],
                         ids=["tied", "untied", "untied_by_default", "head_dim"])
def test_the_parameter_count_is_transformers_own_for_the_model(shape):
    """The plan's count (one block, the root, the total) is what transformers builds for a Qwen2 config:
    grouped-query or not, tied head or not (untied where config.json does not say), a head_dim of its own."""
    import torch
    import transformers
    hf = {"model_type": "qwen2", **QWEN2, **shape}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**hf))
    total = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
    block = sum(p.numel() for p in model.model.layers[0].parameters())
    n = plan.parameter_counts(hf)
    assert (n["block"], n["total"], n["root"]) == (block, total, total - hf["num_hidden_layers"] * block)


def test_a_model_of_two_kinds_of_block_gathers_its_largest():
    """DeepSeek-V3's first blocks are dense and the rest mixtures of experts, about 5 times their parameters
    here (at 671B: 11.5B against 0.58B): the plan gathers two of the largest, and the root is what no block
    holds (1.85B). It counted the first block for all: two dense blocks gathered, and a root of 635B."""
    import torch
    import transformers
    hf = dict(model_type="deepseek_v3", vocab_size=100, hidden_size=128, intermediate_size=128,
              moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
              num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=64, kv_lora_rank=32,
              qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, num_hidden_layers=3, first_k_dense_replace=1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
    per_layer = {}
    for name, p in model.named_parameters():
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            per_layer[layer] = per_layer.get(layer, 0) + p.numel()
    total = sum(p.numel() for p in model.parameters())
    assert per_layer[1] == per_layer[2] > 4 * per_layer[0]
    assert plan.parameter_counts(hf) == {"root": total - sum(per_layer.values()), "block": per_layer[1],
                                         "total": total}


@pytest.mark.parametrize("family", ["gpt2_path", "neox_path", "gemma2_path"])
def test_another_familys_parameters_are_counted_as_its_folder_holds_them(family, request):
    """The plan counted every model as a Qwen2 (three MLP matrices, q/k/v biases): GPT-2's and GPT-NeoX's
    two-matrix MLPs a third over (Pythia-1B planned as 1.28B parameters; it has 1.01B). Its count is the
    folder's weights (a tied head saved once), all and the first block's."""
    from safetensors import safe_open
    from minirl.config import ModelConfig
    path = request.getfixturevalue(family)
    hf, _ = plan.model_config(ModelConfig(path=path))
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        sizes = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys()}
    first = [k for k in sizes if re.match(r"(transformer\.h|gpt_neox\.layers|model\.layers)\.0\.", k)]
    n = plan.parameter_counts(hf)
    assert first and (n["total"], n["block"]) == (sum(sizes.values()), sum(sizes[k] for k in first))


FAMILIES = {  # small configs of families whose blocks differ: norms, MLP, activation, attention kernel
    "qwen2": dict(model_type="qwen2", **QWEN2),
    "gpt2": dict(model_type="gpt2", vocab_size=100, n_embd=128, n_inner=512, n_layer=3, n_head=4),
    "gpt_neox": dict(model_type="gpt_neox", vocab_size=100, hidden_size=128, intermediate_size=512,
                     num_hidden_layers=3, num_attention_heads=4),
    "opt": dict(model_type="opt", vocab_size=100, hidden_size=128, ffn_dim=512, num_hidden_layers=3,
                num_attention_heads=4, word_embed_proj_dim=128),
    "falcon": dict(model_type="falcon", vocab_size=100, hidden_size=128, num_hidden_layers=3, num_attention_heads=4),
    "gemma2": dict(model_type="gemma2", **QWEN2, head_dim=32),
    "olmo2": dict(model_type="olmo2", **QWEN2),
    "gpt_oss": dict(model_type="gpt_oss", **{**QWEN2, "intermediate_size": 128}, head_dim=32, num_local_experts=4,
                    num_experts_per_tok=2),  # attention with sinks: eager, a (T, T) matrix per head
}


def saved_by_a_block(config: dict, T: int) -> float:
    """Bytes per token one decoder block keeps for backward as the trainer runs it (train(), dropout 0.0,
    real tensors, bfloat16): what the graph of a model of two blocks holds at the end of its forward
    beyond one of one block, each storage once (the parameters left out)."""
    import weakref
    import torch
    import transformers

    def saved(layers: int) -> int:
        hf = transformers.AutoConfig.for_model(**config)
        hf.num_hidden_layers = layers
        for key, value in hf.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(hf, key, 0.0)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16).train()
        skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        kept = []

        def keep(t):
            kept.append(weakref.ref(t))
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            out = model(input_ids=torch.randint(0, hf.vocab_size, (1, T)), use_cache=False)
        held = [t.untyped_storage() for ref in kept if (t := ref()) is not None]  # a dropped node's are freed
        del out
        return sum({s.data_ptr(): s.nbytes() for s in held if s.data_ptr() not in skip}.values())
    return (saved(2) - saved(1)) / T


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_activation_term_is_what_the_familys_own_blocks_save_for_backward(family):
    """What the blocks keep for backward per token, as the plan counts it (the model's own blocks on fake
    tensors), is what real blocks of that family keep on the host, whatever their norms (OLMo 2's and
    Gemma 2's: 35% and 44% more than Qwen2's at these widths), MLP (OPT's two matrices: 48% less) or
    attention kernel (gpt-oss's eager one grows with the row). The Qwen2 arithmetic it replaces was 20-25%
    under for those two, half for gpt-oss at 96 tokens, and 1.5-2.5 times over for GPT-NeoX, Falcon and
    OPT. A row over 512 tokens is on the line through 256 and 512 (within 0.1%: a few fixed-size tensors).
    A micro-batch keeps that for every block, or under activation checkpointing every block's input
    and one block's. (Falcon's config.json as the plan reads it names a head_dim that Falcon computes:
    building it failed the dry run.)"""
    config = FAMILIES[family]
    hf = plan.with_sizes(dict(config))
    L, h = hf["num_hidden_layers"], hf["hidden_size"]
    for T, rel in ((1000, 1e-3), (32, 1e-12), (96, 1e-12)):  # 1000: on the line through 256 and 512 tokens
        block = saved_by_a_block(config, T)
        every, largest = plan.saved_per_token(json.dumps(config, sort_keys=True), "bfloat16", T)
        assert (every, largest) == (pytest.approx(L * block, rel=rel), pytest.approx(block, rel=rel)), T
    assert plan.activation_bytes(hf, "bfloat16", 2 * T, T, checkpointing=False) == pytest.approx(2 * T * L * block,
                                                                                                 rel=1e-9)
    assert plan.activation_bytes(hf, "bfloat16", 2 * T, T, checkpointing=True) == pytest.approx(
        2 * T * (L * 2 * h + block), rel=1e-9)


def test_a_model_of_two_kinds_of_block_is_counted_block_by_block():
    """DeepSeek-V3 keeps its first blocks dense (first_k_dense_replace) and the rest mixtures of experts: the
    plan counts each block as what it is (every block: one dense block and two of experts; under activation
    checkpointing the larger kind reruns), not the first block times the count."""
    base = dict(model_type="deepseek_v3", vocab_size=100, hidden_size=128, intermediate_size=128,
                moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=64, kv_lora_rank=32,
                qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, num_hidden_layers=3)
    dense = saved_by_a_block({**base, "first_k_dense_replace": 3}, 64)
    experts = saved_by_a_block({**base, "first_k_dense_replace": 0}, 64)
    mixed = json.dumps({**base, "first_k_dense_replace": 1}, sort_keys=True)
    assert dense < experts  # the largest block is not the first
    assert plan.saved_per_token(mixed, "bfloat16", 64) == (pytest.approx(dense + 2 * experts, rel=1e-12),
                                                           max(dense, experts))


def test_a_block_fake_tensors_cannot_run_is_counted_as_a_qwen2_block_of_its_widths():
    """JetMoE's routing reads a value (fake tensors have none): its block is counted as a Qwen2 block of its
    widths, 8h + 2kv + 4i values in the compute dtype and 2h in float32 (a real Qwen2 block keeps that but
    about two hidden-size vectors: `test_the_activation_term_is_what_the_familys_own_blocks_save_for_backward`)."""
    hf = plan.with_sizes(dict(model_type="jetmoe", vocab_size=100, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, kv_channels=16))
    h, i, kv = 128, 256, 2 * 16  # a head narrower than hidden / heads: the config's is read
    for dtype, c in (("bfloat16", 2), ("float32", 4)):
        block = c * (8 * h + 2 * kv + 4 * i) + 8 * h
        assert plan.saved_per_token(json.dumps(hf, sort_keys=True), dtype, 64) == (2 * block, block)


def shares(lines):
    """{rank: {field: value}} from the plan's share column."""
    return {int(m.group(1)): dict(re.findall(r"(\w+)<?=(\S+)", m.group(7)))
            for m in (LINE.fullmatch(line) for line in lines if line.startswith("rank "))}


def test_each_ranks_share_is_what_the_loop_gives_it(tmp_path):
    """A rank's prompts, rows and micro-batches in the plan are the ones the loops compute: GRPO's
    canonical partition and chunk plan over 8 ranks; PPO's prompts i % R on rollout rank i and the batch
    split over the train ranks, disaggregated, or over every rank, colocated."""
    from minirl.batch import plan_chunks
    from minirl.tasks import dp_partition, prompt_id
    args, nproc = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_grpo_3b.sh"), tmp_path)
    rl, T = args.rl, args.rollout.max_model_len
    P, G = rl.batch_per_replica // rl.group_size, rl.group_size
    keys = [(prompt_id(0, i), j) for i in range(P) for j in range(G)]
    for r, got in shares(plan.dry_run(args)).items():
        rows = dp_partition(keys, r, nproc)
        chunks = plan_chunks([T] * len(rows), args.n_mini, args.micro_batch // nproc)
        assert got == {"prompts": str(len({keys[i][0] for i in rows})), "rows": str(len(rows)),
                       "n_mini": str(len(chunks)), "n_micro": str(len(chunks[0])), "micro_rows": str(len(chunks[0][0])),
                       "tokens": str(T)}, got

    args, nproc = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_ppo_8gpu.sh"), tmp_path)
    args.ppo.num_generations_per_prompt = 4
    p, T = args.ppo, args.rollout.max_model_len
    for placement, R in (("disaggregated", args.grid.rollout_ranks), ("colocated", 0)):
        args.grid.gpu_placement = placement
        if placement == "colocated":  # full batch (colocated PPO does not stream), split over all 8 ranks
            p.num_prompts_per_step = args.async_rl.min_groups_for_streaming_train = 256
        got = shares(plan.dry_run(args))
        for r in range(R):
            prompts = sum(i % R == r for i in range(p.num_prompts_per_step))
            assert got[r] == {"prompts": str(prompts), "rows": str(prompts * p.num_generations_per_prompt)}, got[r]
        dp = nproc - R
        rows = p.num_prompts_per_step * p.num_generations_per_prompt // dp
        for r in range(R, nproc):
            assert got[r] == {"prompts": str(p.num_prompts_per_step // dp), "rows": str(rows), "n_mini": "1",
                              "n_micro": str(-(-rows // (p.policy_micro_batch_rows or rows))),
                              "epochs": str(p.ppo_epochs), "critic_rows": str(p.critic_micro_batch_rows or rows),
                              "tokens": str(T)}, (placement, got[r])


def test_inside_a_torchrun_launch_a_node_is_its_local_world(tmp_path, monkeypatch):
    """`--dry-run` under torchrun plans its own launch: 8 ranks of LOCAL_WORLD_SIZE 4 are 2 nodes, and
    rank 5 is card 1 of node 1. Planning a launch of another size there, its nodes do not apply."""
    args = tyro.cli(GRPOArgs, args=["--dry-run", "--dry-run-device", "cuda", "--rl.batch-per-replica", "64"])
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")  # only rank 0 prints
    lines = plan.dry_run(args)
    assert lines[1] == "plan: 2 nodes x 4 ranks; a rank's card is its index on its node", lines
    assert lines[7].startswith("rank 5: node=1 role=both trainer=cuda:1 engine=cuda:1 "), lines
    monkeypatch.setenv("WORLD_SIZE", "16")
    args.dry_run_world_size = 8  # another launch than this one: one node of 8
    lines = plan.dry_run(args)
    assert len(lines) == 9 and lines[8].startswith("rank 7: role=both trainer=cuda:7 "), lines


def test_a_model_folder_or_a_cached_hub_name_is_planned_from_its_config_offline(tmp_path, monkeypatch):
    """A local folder given as a relative `dir/name` path reads that folder's config.json (it is not
    looked up as a hub name); a hub name already in the Hugging Face cache reads the cached one."""
    import shutil
    import huggingface_hub.constants
    shutil.copytree(os.path.join(MODELS, "Qwen2.5-0.5B-Instruct"), tmp_path / "models" / "local")
    monkeypatch.chdir(tmp_path)
    args = tyro.cli(GRPOArgs, args=["--model.path", "models/local"])
    hf, source = plan.model_config(args.model)
    assert source == os.path.join("models", "local", "config.json") and hf["hidden_size"] == 896
    snapshot = tmp_path / "hub" / "models--someorg--cached" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"hidden_size": 7}')
    (tmp_path / "hub" / "models--someorg--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--cached" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    args.model.path = "someorg/cached"
    assert plan.model_config(args.model) == ({"hidden_size": 7}, str(snapshot / "config.json"))


def test_each_memory_term_is_the_one_the_plan_documents(tmp_path):
    """The train rank's terms, spelled out for the 0.5B GRPO recipe (one rank, bf16, a KL reference) and the
    PPO recipe (6 train ranks): float32 masters sharded plus the root and two blocks gathered in bf16 (and
    the reference's bf16 shard and gather), float32 gradients, AdamW's two float32 moments, one micro-batch's
    activations, one piece of the chunked head (its bf16 logits and two float32 copies, and the head's summed
    float32 weight gradient). A PPO save holds both models and both optimizers, the reference's shard and
    the largest gathered weight."""
    from minirl import models
    G = 2**30
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_grpo_1gpu.sh"), tmp_path)
    hf, _ = plan.model_config(args.model)
    n, c, V, h = plan.parameter_counts(hf), 2, hf["vocab_size"], hf["hidden_size"]
    T = args.rollout.max_model_len
    tokens = args.micro_batch * T
    gathered = c * (n["root"] + 2 * n["block"])
    piece = min(tokens, models.LOGITS_CHUNK // V)
    assert args.rl.kl_coef and args.model.activation_checkpointing
    assert plan.train_rank_terms(args, 1, hf) == pytest.approx({
        "params": (4 * n["total"] + gathered + c * n["total"] + gathered) / G, "grads": 4 * n["total"] / G,
        "optimizer": 8 * n["total"] / G, "activations": plan.activation_bytes(hf, "bfloat16", tokens, T, True) / G,
        "logits": (piece * V * (c + 8) + 4 * V * h) / G}, rel=1e-12)

    args.model.dtype = "float32"  # the head's gradient is float32 already: no summed copy
    assert plan.train_rank_terms(args, 1, hf)["logits"] == pytest.approx(piece * V * (4 + 8) / G, rel=1e-12)

    args, nproc = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_ppo_8gpu.sh"), tmp_path)
    hf, _ = plan.model_config(args.model)
    n, V, h, p = plan.parameter_counts(hf), hf["vocab_size"], hf["hidden_size"], args.ppo
    dp = nproc - args.grid.rollout_ranks
    rows = p.num_prompts_per_step * p.num_generations_per_prompt // dp
    tokens = max(p.policy_micro_batch_rows, p.critic_micro_batch_rows) * args.rollout.max_model_len
    assert p.policy_micro_batch_rows < rows and p.kl_coef
    gathered, ref = c * (n["root"] + 2 * n["block"]), c * n["total"] / dp

    def save(dp):  # both models and both optimizers, the reference's shard, the largest gathered weight
        return {"params": (2 * 4 * n["total"] / dp + c * n["total"] / dp + c * V * h) / G, "grads": 0.0,
                "optimizer": 2 * 8 * n["total"] / dp / G, "activations": 0.0, "logits": 0.0}
    train = {"params": (4 * n["total"] / dp + gathered + ref + gathered) / G, "grads": 4 * n["total"] / dp / G,
             "optimizer": 8 * n["total"] / dp / G,
             "activations": plan.activation_bytes(hf, "bfloat16", tokens, args.rollout.max_model_len,
                                                  args.model.activation_checkpointing) / G,
             "logits": (min(tokens, models.LOGITS_CHUNK // V) * V * (c + 8) + 4 * V * h) / G}
    assert plan.train_rank_terms(args, nproc, hf) == pytest.approx(max(train, save(dp), key=lambda t: sum(t.values())),
                                                                   rel=1e-12)
    # two train ranks and one row per micro-batch: the save's two models and optimizers are the peak
    nproc, args.grid.rollout_ranks, args.ppo.policy_micro_batch_rows, args.ppo.critic_micro_batch_rows = 4, 2, 1, 1
    assert plan.train_rank_terms(args, nproc, hf) == pytest.approx(save(2), rel=1e-12)
    disaggregated = plan.train_rank_terms(args, 6, hf)  # 2 rollout ranks, 4 train ranks
    args.grid.gpu_placement = "colocated"  # every one of 4 ranks trains: the same shares
    assert plan.train_rank_terms(args, 4, hf) == disaggregated


def test_a_grpo_rank_that_does_not_fit_is_told_the_micro_batch_and_checkpointing_that_do(tmp_path):
    """The 3B GRPO recipe without activation checkpointing on 80 GiB cards: at 4,096-token completions the
    plan names the largest micro-batch per replica that splits the mini-batch and fits (re-planned, it
    fits; the next larger split does not); at 16,384 no micro-batch fits without activation
    checkpointing, and the plan says to turn it on."""
    import dataclasses
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_grpo_3b.sh"), tmp_path)
    args.model.activation_checkpointing, args.rollout.max_tokens = False, 4096

    def rank0(micro=None, checkpointing=False):
        tried = dataclasses.replace(args, model=dataclasses.replace(args.model, activation_checkpointing=checkpointing),
                                    rl=dataclasses.replace(args.rl, micro_batch_per_replica=micro or
                                                           args.rl.micro_batch_per_replica))
        return next(x for x in plan.dry_run(tried) if x.startswith("rank 0:"))
    hint = re.search(r"\(DOES NOT FIT\); fits with --rl.micro-batch-per-replica (\d+) \(peak ([\d.]+)\)$", rank0())
    assert hint, rank0()
    micro = int(hint.group(1))
    assert args.mini_batch % micro == 0 and 2 * micro <= args.rl.micro_batch_per_replica
    assert rank0(micro).endswith("(fits)") and f"peak {hint.group(2)} of 80" in rank0(micro)
    assert "DOES NOT FIT" in rank0(2 * micro)
    args.rollout.max_tokens = 16384
    hint = re.search(r"fits with --rl.micro-batch-per-replica (\d+) --model.activation-checkpointing \(peak", rank0())
    assert hint and rank0(int(hint.group(1)), checkpointing=True).endswith("(fits)"), rank0()
    assert "DOES NOT FIT" in rank0(8)  # one row per rank, without checkpointing


def test_the_built_in_model_is_planned_as_it_is_built(tmp_path, monkeypatch):
    """The plan's config of `--model.path tiny` (never built by a dry run) is the built model's own
    config.json, and its parameter count the built weights'; a path that is neither a folder nor a hub
    name is refused, and so is a context longer than the model's positions."""
    import json
    from safetensors import safe_open
    from minirl.config import ConfigError
    from minirl.models import build_tiny
    monkeypatch.setenv("MINIRL_CACHE", str(tmp_path / "cache"))
    args = tyro.cli(GRPOArgs, args=["--model.tiny.hidden-size", "64", "--model.tiny.intermediate-size", "96",
                                    "--model.tiny.num-heads", "4", "--model.tiny.num-kv-heads", "2"])
    args.model.tiny.warm_start_steps = 0  # the shape is what matters; no training
    planned, source = plan.model_config(args.model)
    built = build_tiny(args.model.tiny)
    with open(os.path.join(built, "config.json")) as f:
        config = json.load(f)
    assert source == "the built-in tiny model" and planned == {k: config[k] for k in planned}
    with safe_open(os.path.join(built, "model.safetensors"), "pt") as f:
        weights = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert plan.parameter_counts(planned)["total"] == weights
    args.model.path = str(tmp_path / "no" / "such" / "folder")
    with pytest.raises(ConfigError, match="does not exist"):
        plan.dry_run(args)
    args.model.path, args.rollout.max_prompt_tokens, args.rollout.max_tokens = "tiny", 200, 100
    with pytest.raises(ConfigError, match=r"--rollout.max-prompt-tokens \+ --rollout.max-tokens = 300 tokens is over"):
        plan.dry_run(args)


def test_the_plan_says_the_model_size_the_token_budget_and_the_host_memory(tmp_path, monkeypatch):
    """The header gives the model's parameters in billions; a token budget per micro-batch shows as
    `n_micro=budget` with its tokens as the activations' micro-batch; a train rank of disaggregated PPO has
    no engine and no publish term; on a CPU every rank's engine term is its KV cache in host memory; and
    a dry run outside torchrun plans one rank."""
    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_grpo_1gpu.sh"), tmp_path)
    hf, source = plan.model_config(args.model)
    lines = plan.dry_run(args)
    assert lines[0] == (f"plan: minirl.grpo, 1 rank(s) on cuda, colocated; model {source} "
                        f"({plan.parameter_counts(hf)['total'] / 1e9:.2f}B parameters)")
    args.rl.micro_batch_per_replica, args.rl.max_tokens_per_micro_batch = 0, 4096
    line = plan.dry_run(args)[1]
    share = shares([line])[0]
    assert share["n_micro"] == "budget" and share["micro_rows"] == "-", line
    activations = plan.activation_bytes(hf, "bfloat16", 4096, args.rollout.max_model_len,
                                        args.model.activation_checkpointing) / 2**30
    assert f"activations {activations:.2f} " in line

    args, _ = recipe_args(os.path.join(ROOT, "recipes", "gsm8k_ppo_8gpu.sh"), tmp_path)
    train = next(x for x in plan.dry_run(args) if x.startswith("rank 2:"))
    assert " engine 0.00 |" in train and "publish" not in train, train
    args.dry_run_device, args.rollout.kv_cache_gib = "cpu", 3.0
    for line in plan.dry_run(args)[1:]:
        engine = 3.0 if LINE.fullmatch(line).group(2) == "rollout" else 0.0
        assert f" engine {engine:.2f} | peak " in line and line.endswith("(host memory)"), line

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args.dry_run_world_size, args.grid.gpu_placement = 0, "colocated"
    args.ppo.num_prompts_per_step = args.async_rl.min_groups_for_streaming_train = 8
    assert [x.split(":")[0] for x in plan.dry_run(args)[1:]] == ["rank 0"]


def test_a_config_of_other_names_is_read_as_transformers_reads_it_and_a_vision_language_one_is_refused(gpt2_path,
                                                                                                      tmp_path):
    """GPT-2's config.json names its sizes n_embd, n_head, n_layer and n_positions and leaves its MLP width unset
    (4 x hidden): the plan and the engine's check read them through transformers (both read Llama's names, and
    failed with a KeyError). A vision-language model (Gemma 3 from 4B on: its language model's settings under
    text_config, also a KeyError) is refused in one line, by the dry run and the run alike."""
    from minirl.config import ConfigError, RolloutConfig
    from minirl.rollout import check_model
    args = tyro.cli(GRPOArgs, args=["--model.path", gpt2_path, "--log.run-dir", str(tmp_path / "run")])
    hf, _ = plan.model_config(args.model)
    assert [hf[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                            "max_position_embeddings")] == [64, 2, 2, 256, 256]
    assert any(line.startswith("rank 0: role=both") for line in plan.dry_run(args))
    check_model(gpt2_path, RolloutConfig(), 40, device_type="cpu")
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text('{"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], '
                                       '"text_config": {"hidden_size": 64, "num_attention_heads": 2}}')
    args.model.path = str(gemma)
    for check in (lambda: plan.dry_run(args), lambda: check_model(str(gemma), RolloutConfig(), 40, device_type="cpu")):
        with pytest.raises(ConfigError, match=r"vision-language model \(Gemma3ForConditionalGeneration"):
            check()
