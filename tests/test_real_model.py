"""A real pretrained model through the path users take: SmolLM2-135M-Instruct (Llama architecture, tied
embeddings, a BPE tokenizer with a chat template), built from a package (recipes/prepare_smollm2.py).

Chat prompts through its template, vLLM generation of it on CPU against the trainer's logprobs, the
packed trainer and the chunked head on its tied embedding against plain transformers, one GRPO step
and one streamed PPO step (1 rollout + 1 train rank), and the exported folder reloaded in transformers.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run
from minirl import models
from minirl.config import RolloutConfig, TaskConfig
from minirl.rollout import Engine
from minirl.tasks import encode_prompts, make_task

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    d = tmp_path_factory.mktemp("arith")
    subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "prepare_arith.py"), "--out", str(d),
                    "--train", "16", "--test", "4"], check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def longer(tmp_path_factory):
    """A reward whose groups differ (the completion's length), so a step moves: the strict one pays nothing
    in the 8 tokens these runs sample."""
    path = tmp_path_factory.mktemp("reward") / "length.py"
    path.write_text("def longer(completion, answer):\n    return len(completion) / 100\n")
    return f"{path}:longer"


def plain_logprobs(model, ids):
    """transformers' own: the full logits' float32 log-softmax at each next token."""
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_chat_prompts_render_and_the_trainer_packs_and_chunks_the_tied_head_as_transformers_computes(
        smollm2_path, arith, world):
    tok = models.load_tokenizer(smollm2_path)
    task = make_task(TaskConfig(name="jsonl", path=str(arith / "train.jsonl"), eval_path=str(arith / "test.jsonl"),
                                eval_prompts=4), 0, tok, 96)
    p = task.train_problem(0).prompt
    assert p.startswith("<|im_start|>system\n") and p.endswith("<|im_start|>assistant\n") and "####" in p
    policy = models.sharded(smollm2_path, "policy", world, "float32", True)
    assert policy.pack_rows and policy.chunked_head and policy.config.tie_word_embeddings
    assert policy.get_output_embeddings().weight is policy.get_input_embeddings().weight
    rows = encode_prompts(tok, [q.prompt for q in task.rows[:3]], 96)
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    with torch.no_grad():
        mine = models.token_logprobs(policy, ids, lengths=[len(r) for r in rows])  # packed, chunked head
        ref = models.load_policy(smollm2_path)
        for i, r in enumerate(rows):
            theirs = plain_logprobs(ref, torch.tensor([r]))[0]
            assert (mine[i, 1:len(r)] - theirs).abs().max().item() < 1e-4


def test_vllm_generates_this_llama_and_its_logprobs_are_the_trainers(smollm2_path, arith, world):
    tok = models.load_tokenizer(smollm2_path)
    task = make_task(TaskConfig(name="jsonl", path=str(arith / "train.jsonl"), eval_prompts=0), 0, tok, 96)
    engine = Engine(smollm2_path, RolloutConfig(max_tokens=8, kv_cache_gib=1), max_model_len=104,
                    device=world.device, seed=0)
    try:
        prompts = encode_prompts(tok, [task.train_problem(i).prompt for i in range(2)], 96)
        s = engine.generate(prompts, [1, 2], 2)
    finally:
        engine.close()
    model = models.load_policy(smollm2_path)
    assert any(tok.decode(c, skip_special_tokens=True).strip() for c in s.completion_tokens)  # real text
    with torch.no_grad():
        for p, c, lps in zip(s.prompt_tokens, s.completion_tokens, s.logprobs):
            mine = models.token_logprobs(model, torch.tensor([p + c]))[0, len(p):]
            assert (mine - torch.tensor(lps)).abs().max().item() < 2e-3  # float32 CPU kernels, 30 layers


def test_one_grpo_step_on_chat_prompts_exports_a_folder_transformers_reloads(smollm2_path, arith, longer, tmp_path):
    d = tmp_path / "run"
    p = run([sys.executable, "-m", "minirl.grpo", "--model.path", smollm2_path, "--task.name", "jsonl",
             "--task.reward", longer,  # a reward whose groups differ: the step moves
             "--task.path", str(arith / "train.jsonl"), "--task.eval-path", str(arith / "test.jsonl"),
             "--task.eval-prompts", "2", "--steps", "1", "--rl.batch-per-replica", "4", "--rl.group-size", "2",
             "--rollout.max-tokens", "8", "--rollout.max-prompt-tokens", "96", "--log.eval-every", "1",
             "--log.run-dir", str(d)])
    assert p.returncode == 0
    assert "padding-free training: on" in p.stdout, p.stdout[-2000:]
    rec = [r for r in map(json.loads, open(d / "metrics.jsonl")) if "reward_mean" in r]
    assert len(rec) == 1 and rec[0]["optimizer_steps"] == 1 and rec[0]["logprob_gap"] < 2e-3
    source = {f for f in os.listdir(smollm2_path) if not f.endswith(".safetensors") and f != "README.md"}
    assert "chat_template.jinja" in source and source <= set(os.listdir(d / "final"))  # every file the model needs
    assert all((d / "final" / f).read_bytes() == open(os.path.join(smollm2_path, f), "rb").read() for f in source)
    from transformers import AutoModelForCausalLM
    back = AutoModelForCausalLM.from_pretrained(d / "final", dtype=torch.float32)
    base = models.load_policy(smollm2_path)
    assert back.config.tie_word_embeddings and back.lm_head.weight is back.model.embed_tokens.weight
    moved = max((a - b).abs().max().item() for a, b in zip(back.state_dict().values(), base.state_dict().values()))
    assert moved > 0  # the step trained the weights that were exported
    ids = torch.tensor([models.load_tokenizer(str(d / "final"))("What is 2 plus 3? #### 5").input_ids])
    mine = models.token_logprobs(models.load_policy(str(d / "final")), ids)[0, 1:]  # the trainer's chunked head
    with torch.no_grad():
        assert (mine - plain_logprobs(back, ids)[0]).abs().max().item() < 1e-4


def test_one_streamed_ppo_step_trains_this_model_with_a_critic(smollm2_path, arith, longer, tmp_path):
    """Both models move. Under the strict reward (nothing earned in 8 tokens) and the new value head (0
    everywhere) every advantage, return and gradient was 0; a reward of the completion's length differs by row."""
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "minirl.ppo",
             "--model.path", smollm2_path, "--task.name", "jsonl", "--task.path", str(arith / "train.jsonl"),
             "--task.reward", longer,
             "--task.eval-path", str(arith / "test.jsonl"), "--task.eval-prompts", "2", "--steps", "1",
             "--ppo.num-prompts-per-step", "2", "--ppo.num-generations-per-prompt", "2",
             "--async-rl.min-groups-for-streaming-train", "1", "--async-rl.rollout-groups-per-call", "1",
             "--rollout.max-tokens", "8", "--rollout.max-prompt-tokens", "96", "--log.eval-every", "0",
             "--log.run-dir", str(tmp_path)], timeout=900)
    assert p.returncode == 0
    rec = [r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "reward_mean" in r]
    assert len(rec) == 1 and "ppo_loss" in rec[0] and rec[0]["value_epoch_n"] == 4 and rec[0]["ppo_chunks"] >= 1
    assert rec[0]["reward_std"] > 0 and rec[0]["grad_norm"] > 0 and rec[0]["value_grad_norm"] > 0
    assert (tmp_path / "final" / "model.safetensors").exists()
