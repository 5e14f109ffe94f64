"""The in-process vLLM engine: every vLLM call in minirl sits in this file (vllm 0.32.0, whose Python is
the same in the CPU and CUDA wheels; the one private call is `close()`).

- `Engine.generate(prompts, prompt_ids, group_size)`: one request per prompt with n = group_size,
  seeded from (run seed, prompt id), so a sample depends on its prompt and index, never its place in
  the batch. Returns token ids, the engine's logprob of each sampled token and finish reasons; nothing
  is detokenized in the engine.
- `Engine(..., device)`: built on the card `dist.device_map` gave this rank by vLLM's
  external-launcher executor, which reads the card from LOCAL_RANK (`dist.private_world`).
- `Engine.load_weights(named_tensors)`: trainer weights into the running engine in place
  (`LLM.collective_rpc("reload_weights")`), named and laid out as the model's checkpoint files hold them
  (`as_checkpoint`: transformers 5 fuses some families' weights at load; vLLM reads the files' form).
- `check_model`, `check_reloads`, `check_trainable`: what this engine cannot run or reload here, and a model
  that cannot be trained (a quantized one), refused before anything is built.
- `Engine.sleep(level)` / `wake_up(tags)`: vLLM sleep mode on CUDA; on CPU, which refuses it, the same
  state machine without freeing anything: "awake" -> "asleep" -> "weights" -> "awake". After a level-2
  sleep, generation is refused until one load_weights has rewritten every parameter.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
from collections import deque
from dataclasses import dataclass, field

import torch

from minirl import dist
from minirl.config import ConfigError, RolloutConfig

# vLLM 0.32 CPU attention (vllm/v1/attention/backends/cpu_attn.py: get_supported_head_sizes)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_model(path: str, cfg: RolloutConfig, max_model_len: int, head_dim_flag: str = "--model.path",
                device_type: str | None = None, hf: dict | None = None) -> None:
    """Fail before any engine is built if this model or KV budget cannot run here.
    `hf`: the model's config.json, when the caller has it already (the dry run)."""
    if hf is None:
        with open(os.path.join(path, "config.json")) as f:
            hf = with_sizes(json.load(f))
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    limit = hf.get("max_position_embeddings")
    if limit and max_model_len > limit:
        raise ConfigError(f"--rollout.max-prompt-tokens + --rollout.max-tokens = {max_model_len} tokens is over the "
                          f"model's {limit} positions; lower them (the built-in model: raise --model.tiny.max-positions)")
    on_cpu = (device_type or dist.device_type()) == "cpu"
    if on_cpu and head_dim not in CPU_HEAD_DIMS:
        raise ConfigError(f"{head_dim_flag}: head_dim {head_dim} (hidden_size {hf['hidden_size']} / {heads} heads) "
                          f"is not one vLLM's CPU attention runs; use one of {CPU_HEAD_DIMS}")
    if on_cpu:
        kv_bytes_per_token = 2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", heads) * head_dim * 4
        need = kv_bytes_per_token * max_model_len / 2**30
        import psutil
        have = psutil.virtual_memory().total / 2**30
        if cfg.kv_cache_gib < need:
            raise ConfigError(f"--rollout.kv-cache-gib={cfg.kv_cache_gib} cannot hold one sequence of "
                              f"{max_model_len} tokens ({need:.3f} GiB); raise it")
        if cfg.kv_cache_gib > 0.5 * have:
            raise ConfigError(f"--rollout.kv-cache-gib={cfg.kv_cache_gib} is over half of this machine's "
                              f"{have:.0f} GiB; every engine on the machine reserves it. Try 1")


def check_reloads(path: str, device_type: str | None = None) -> None:
    """Fail before a training run builds anything if this engine cannot take the trainer's weights in place.
    vLLM 0.32's CPU engine packs a mixture of experts' weights for its kernel once, at load
    (vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py, `_setup_kernel`: only when
    `not is_weight_update`); a reload copies unpacked weights over the packed ones (a Mixtral resent its own
    weights sampled 0.04 nats off) or fails on the padded shape. On CUDA a reload copies into the kernel's tensors."""
    with open(os.path.join(path, "config.json")) as f:
        check_trainable(json.load(f))
    if (device_type or dist.device_type()) != "cpu":
        return
    name = next((name for name, _ in meta_model(path).named_parameters() if ".experts." in name), "")
    if name:
        raise ConfigError(f"--model.path is a mixture-of-experts model ({name}): vLLM's CPU engine cannot reload "
                          "expert weights in place (it packs them for its kernel once, at load), so it would not "
                          "sample the trained policy; train it on CUDA GPUs (minirl-eval scores it on a CPU)")


def check_trainable(hf: dict) -> None:
    """A quantized checkpoint (its config.json's `quantization_config`) serves, and is not trained: the trainer's
    masters would be its quantizer's packed tensors (bitsandbytes' and AWQ's load asks for their kernels), and the
    engine's quantized layers take no trained weights back (minirl-eval scores one)."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "") if isinstance(quant, dict) else ""
        raise ConfigError(f"--model.path is a quantized model ({method or 'quantization_config'}): minirl trains a "
                          "model's own weights (float32 masters, no adapters) and sends them to the engine whole; "
                          "give the model it was quantized from, or a BF16 copy of it (minirl-eval scores this one)")


def meta_model(path: str) -> torch.nn.Module:
    """The causal LM in `path` as transformers builds it on the meta device: its names and shapes, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def as_checkpoint(model: torch.nn.Module, named):
    """(name, tensor) pairs of `model`'s parameters -> the same weights as its checkpoint files hold them, the
    form vLLM loads and save_pretrained writes. transformers 5 converts some families at load: a mixture of
    experts' per-expert matrices become one (experts, ...) parameter, Mixtral's `block_sparse_moe` is named
    `mlp`. This reverts it one parameter at a time where each conversion made one parameter (a fusion or a
    rename), and all at once for a family whose load splits a tensor of the files into several (HRM's
    `gate_up_proj`). Other families pass unchanged."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion
    conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model, add_legacy=False)
    if any(len(getattr(c, "target_patterns", ())) > 1 for c in conversions):  # a split: its parts revert together
        yield from revert_weight_conversion(model, dict(named)).items()
        return
    for name, t in named:
        yield from revert_weight_conversion(model, {name: t}).items()


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings")


def with_sizes(hf: dict) -> dict:
    """A config.json with its model's sizes also under Llama's names, as transformers reads them (GPT-2's
    `n_head` is num_attention_heads; its unset MLP width is 4 x hidden); others left unset stay absent."""
    if "text_config" in hf:  # Gemma 3 from 4B on, Gemma 3n and 4: an image encoder beside the language model
        raise ConfigError(f"--model.path is a vision-language model ({(hf.get('architectures') or [''])[0]}, its "
                          "language model's settings under text_config); minirl trains text-only causal language "
                          "models (Gemma 3's text-only one is the 1B)")
    if "model_type" not in hf:  # nothing to read it by (a real run has refused it: launch.check_folder)
        return hf
    from transformers import AutoConfig
    try:
        config = AutoConfig.for_model(**hf)
    except (ValueError, TypeError) as e:  # an unknown model_type (checked before a real run: launch.check_folder)
        raise ConfigError(f"--model.path: this transformers cannot read its config.json ({e})") from e
    sizes = {k: getattr(config, k) for k in SIZES if getattr(config, k, None) is not None}
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") if k not in sizes]
    if missing:
        raise ConfigError(f"--model.path: its config.json sets no {', '.join(missing)} that transformers can read")
    return {"intermediate_size": 4 * sizes["hidden_size"], **hf, **sizes}


@contextlib.contextmanager
def _engine_output(log_file: str | None):
    """The engine's start-up output (vLLM's logger, Python warnings, and what its native libraries
    print on file descriptors 1 and 2) goes to `log_file`; vLLM's logger stays there afterwards."""
    if log_file is None:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
    sink = open(log_file, "a", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(sink.fileno(), 1)
    os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        vllm_log = logging.getLogger("vllm")  # configured by vLLM's import, inside the block
        vllm_log.handlers, vllm_log.propagate = [logging.StreamHandler(sink)], False


def request_seed(seed: int, prompt_id: int) -> int:
    """A 30-bit seed per (run, prompt); sample j of the prompt gets this + j (vLLM's parallel sampling)."""
    h = hashlib.blake2b(f"{seed}:{prompt_id}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little") & 0x3FFFFFFF


@dataclass
class Samples:
    """One row per sample, in prompt order: prompt i's samples are rows i*G .. i*G+G-1."""

    prompt_ids: list[int]                # (B,) prompt id of each row
    prompt_tokens: list[list[int]]       # (B, prompt len)
    completion_tokens: list[list[int]]   # (B, completion len), EOS included when sampled
    logprobs: list[list[float]]          # (B, completion len) engine logprob of each sampled token
    finish_reasons: list[str]            # (B,) "stop" or "length"
    texts: list[str] = field(default_factory=list)  # (B,) the completions decoded (tasks.scored)

    @property
    def lengths(self) -> list[int]:
        """(B,) completion lengths in tokens."""
        return [len(c) for c in self.completion_tokens]

    @property
    def clipped(self) -> list[bool]:
        """(B,) cut by --rollout.max-tokens (finish reason "length"): every reward gives such a row 0."""
        return [f == "length" for f in self.finish_reasons]


@dataclass
class Engine:
    path: str
    cfg: RolloutConfig
    max_model_len: int
    device: torch.device           # this rank's engine card (dist.device_map)
    dtype: str = "float32"
    seed: int = 0
    sleep_mode: bool = False       # colocated hand-off; vLLM only supports it on CUDA
    private: bool = False          # build in a world of one (disaggregated rollout ranks)
    log_file: str | None = None    # the engine's own log lines go here (None: the console)
    state: str = "awake"
    events: deque = field(default_factory=lambda: deque(maxlen=64))  # recent sleep / wake / load, for tests
    loads: int = 0                 # load_weights calls so far
    _stale: bool = False           # level-2 sleep discarded the weights: a full sync must come first

    def __post_init__(self):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the model in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.cfg.kv_cache_gib)))

        on_cuda = self.device.type == "cuda"
        self._vllm_sleeps = self.sleep_mode and on_cuda
        threads = torch.get_num_threads()  # vLLM lowers torch's thread count for serving; the trainer wants it back
        kwargs = dict(model=self.path, dtype=self.dtype, seed=self.seed, max_model_len=self.max_model_len,
                      tensor_parallel_size=1, enable_prefix_caching=False,
                      enforce_eager=(not on_cuda) if self.cfg.enforce_eager is None else self.cfg.enforce_eager,
                      enable_sleep_mode=self._vllm_sleeps, distributed_executor_backend="external_launcher",
                      # a sampled token's logprob under the distribution it was drawn from (after temperature,
                      # and top-k/top-p where set; the trainer divides by the temperature alone), as TRL sets it
                      # (trl/generation/vllm_generation.py); greedy: the raw one (vllm/v1/sample/sampler.py)
                      logprobs_mode="processed_logprobs",
                      # CUDA graphs' memory leaves the card at sleep too, restored in place at wake (vLLM
                      # keeps it resident by default: config/model.py, sleep_mode_offload_cudagraph)
                      sleep_mode_offload_cudagraph=self._vllm_sleeps)
        if on_cuda:
            kwargs["gpu_memory_utilization"] = self.cfg.gpu_memory_utilization
        if not self.private and on_cuda and int(os.environ.get("LOCAL_RANK", 0)) != self.device.index:
            raise RuntimeError(f"rollout: engine device {self.device} is not LOCAL_RANK's card "
                               f"{os.environ.get('LOCAL_RANK')}; vLLM's external launcher would take that one")
        with _engine_output(self.log_file):
            from vllm import LLM  # vLLM's import-time messages go to the log file too
            if self.private:  # a disaggregated rollout rank: a world of one on this engine's card
                with dist.private_world(self.device):
                    self.llm = LLM(**kwargs)
            else:  # share torchrun's world: each rank is its own TP=1 engine, on the card LOCAL_RANK names
                self.llm = LLM(**kwargs)
        torch.set_num_threads(threads)
        # Every in-place reload warns that the rotary embedding (a buffer, nothing to load) got no weights.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda r: "RotaryEmbedding" not in r.getMessage())

    # ---- sampling ----
    def generate(self, prompts: list[list[int]], prompt_ids: list[int], group_size: int,
                 greedy: bool = False, max_tokens: int | None = None) -> Samples:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.state != "awake" or self._stale:
            raise RuntimeError(f"rollout: generate() while the engine is {self.state}"
                               f"{' with stale weights' if self._stale else ''} (hand-off order bug)")
        reqs = [TokensPrompt(prompt_token_ids=list(toks)) for toks in prompts]
        params = [SamplingParams(n=group_size, max_tokens=max_tokens or self.cfg.max_tokens, logprobs=0,
                                 min_tokens=0 if greedy else self.cfg.min_tokens,
                                 temperature=0.0 if greedy else self.cfg.temperature,
                                 top_p=1.0 if greedy else self.cfg.top_p, top_k=0 if greedy else self.cfg.top_k,
                                 seed=None if greedy else request_seed(self.seed, pid),
                                 detokenize=False, skip_clone=True)  # fresh objects: a shallow copy is safe
                  for pid in prompt_ids]
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        comp = [c for o in outs for c in o.outputs]  # sample j of prompt i at row i*G + j (outputs by index)
        return Samples(
            prompt_ids=[pid for pid in prompt_ids for _ in range(group_size)],
            prompt_tokens=[list(o.prompt_token_ids) for o in outs for _ in range(group_size)],
            completion_tokens=[list(c.token_ids) for c in comp],
            logprobs=[[lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)] for c in comp],
            finish_reasons=[c.finish_reason for c in comp])

    # ---- weights ----
    @functools.cached_property
    def _tied(self) -> dict[str, str]:
        """{head: embedding} of the weights the model ties, by transformers' own map of its class
        (GPT-2's lm_head is transformer.wte); {} when its config unties them, or when the engine's model
        has no head of its own (vLLM's Gemma 2 computes its logits with the embedding). Read at the first
        weight sync, once: the model's config and the engine's model do not change."""
        import transformers
        config = transformers.AutoConfig.from_pretrained(self.path)
        keys = getattr(getattr(transformers, (config.architectures or [""])[0], None), "_tied_weights_keys", None)
        if not config.tie_word_embeddings or not all(self.llm.apply_model(lambda model: hasattr(model, "lm_head"))):
            return {}
        return dict(keys) if isinstance(keys, dict) else {"lm_head.weight": "model.embed_tokens.weight"}

    @functools.cached_property
    def _model(self):
        """The transformers model on the meta device: what `as_checkpoint` reverts the trainer's names by."""
        return meta_model(self.path)

    def load_weights(self, named_tensors) -> int:
        """Write the trainer's (name, tensor) pairs into the engine, as the model's checkpoint files name and lay
        them out (`as_checkpoint`: what vLLM reads); returns how many."""
        if self.state == "asleep":
            raise RuntimeError("rollout: load_weights() while asleep; wake_up(['weights']) first")
        n, tied = 0, self._tied

        def counted():
            nonlocal n
            sent = {}
            for name, t in as_checkpoint(self._model, named_tensors):
                n += 1
                sent[name] = t if name in tied.values() else None
                yield name, t
            # Hazard (vllm 0.32, CPU): with tied embeddings HF has no lm_head parameter, and a layerwise
            # reload that hands ParallelLMHead nothing restores its OLD packed weights, so logits come
            # from stale weights (seen: 18 nats off). Sending the head explicitly keeps it in step.
            for head, embedding in tied.items():
                if head not in sent and sent.get(embedding) is not None:
                    yield head, sent[embedding]

        # In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): the iterator is consumed in this
        # process, tensor by tensor, by the worker's model runner (vllm 0.32 gpu_worker.Worker.reload_weights;
        # the CPU worker inherits it).
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
        self._stale = False  # reload_weights rewrites every parameter it is handed; callers send all of them
        self.events.append(f"load_weights:{n}")
        self.loads += 1
        return n

    def close(self) -> None:
        """Tear the engine down while the process group it shares is still alive."""
        self.llm.llm_engine.engine_core.shutdown()  # private (vllm 0.32 has no public shutdown): the in-process core

    # ---- colocated hand-off ----
    def sleep(self, level: int | None = None) -> None:
        level = level or self.cfg.sleep_level
        if self.state == "asleep":
            return  # idempotent
        if self._vllm_sleeps:
            self.llm.sleep(level=level)
        self._stale = self._stale or level == 2
        self.state = "asleep"
        self.events.append(f"sleep:{level}")

    def wake_up(self, tags: list[str]) -> None:
        if self._vllm_sleeps:
            self.llm.wake_up(tags=tags)
        if "kv_cache" in tags:
            self.state = "awake"
        elif self.state == "asleep":
            self.state = "weights"
        self.events.append(f"wake:{'+'.join(tags)}")
