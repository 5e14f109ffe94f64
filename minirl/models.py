"""Policy, value and reference models, and the built-in tiny model, all loaded one way.

Contract: every model comes from a local Hugging Face folder. `resolve_path` turns
`--model.path` (a folder, a hub name, or `tiny`) into that folder BEFORE anything heavy is
built, so a bad path fails fast; the trainer and the vLLM engine then read the same folder.
The tiny model is a Qwen2 with a character-level tokenizer built with `tokenizers` (no
download), given a deliberately short supervised warm start on the built-in task
(tasks.warm_start), and written once with `save_pretrained` into a cache folder.

Shapes: B sequences, T tokens, V vocab.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minirl.config import TINY, ConfigError, ModelConfig, TinyModelConfig

# The tiny tokenizer's alphabet: one token per character, plus the specials.
SPECIALS = ["<pad>", "<eos>", "<unk>"]
ALPHABET = list("0123456789abcdefghijklmnopqrstuvwxyz+-*=?:,.#()")  # no space: the char pre-tokenizer drops it


def cache_dir() -> str:
    return os.environ.get("MINIRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "minirl"))


def resolve_path(cfg: ModelConfig) -> str:
    """Return a local folder holding config.json and a tokenizer, or raise ConfigError naming --model.path."""
    if cfg.path == TINY:
        return build_tiny(cfg.tiny)
    if os.path.isdir(cfg.path):
        if not os.path.isfile(os.path.join(cfg.path, "config.json")):
            raise ConfigError(f"--model.path={cfg.path!r} has no config.json: not a Hugging Face model folder")
        return cfg.path
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", cfg.path):
        raise ConfigError(f"--model.path={cfg.path!r} does not exist; give a local model folder, a hub name "
                          f"like Qwen/Qwen2.5-0.5B-Instruct, or `{TINY}` for the built-in model")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(cfg.path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])
    except Exception as e:  # offline, unknown repo, gated...
        raise ConfigError(f"--model.path={cfg.path!r}: could not fetch it from the hub ({type(e).__name__}: {e}); "
                          "download it elsewhere and pass the local folder") from e


# ---- the built-in tiny model ----

def build_tiny(shape: TinyModelConfig) -> str:
    """Write (once) and return the tiny model's folder. Safe to call from many ranks at once."""
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    key = hashlib.sha1(json.dumps([shape.__dict__, ALPHABET, 1]).encode()).hexdigest()[:10]
    path = os.path.join(cache_dir(), f"tiny-{key}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".tiny-")
    tok = PreTrainedTokenizerFast(tokenizer_object=_char_tokenizer(), pad_token="<pad>",
                                  eos_token="<eos>", unk_token="<unk>")
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_positions, tie_word_embeddings=True,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        rope_theta=10000.0, dtype="float32")
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the cached weights never depend on a run's seed
        model = Qwen2ForCausalLM(config)
        if shape.warm_start_steps:
            from minirl.tasks import warm_start
            warm_start(model, tok, shape.warm_start_steps)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another rank got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + ALPHABET)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return tok


# ---- loading ----

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_policy(path: str) -> nn.Module:
    """The policy in float32: its parameters are the optimizer's master weights. Forward and
    backward compute in `--model.dtype` through FSDP2's mixed precision (dist.shard)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def load_reference(path: str, dtype: str = "float32") -> nn.Module:
    """The frozen policy at its starting weights, for the KL penalty. It never steps, so it is
    stored in the compute dtype (no master copy to keep)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).eval()
    model.config.use_cache = False
    model.requires_grad_(False)
    return model


class ValueModel(nn.Module):
    """The policy's backbone with a scalar head per token: (B, T) ids -> values (B, T).

    Column t is V of the prefix BEFORE token t, the state in which token t was chosen, so it
    lines up with `token_logprobs` column t (the action). Reading the head at position t itself
    would let the baseline see the action it judges (for the last token it would already
    predict the reward, and the advantage of the deciding token would vanish). Column 0 is 0.
    Attribute `model` is the backbone so FSDP wrapping (dist.shard) finds its decoder blocks.
    The head starts at zero: the critic's first predictions are 0, not noise.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone
        self.score = nn.Linear(hidden_size, 1, bias=True)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids).last_hidden_state  # (B, T, H)
        v = self.score(hidden).squeeze(-1).float()                  # (B, T): V after each token
        return torch.nn.functional.pad(v[:, :-1], (1, 0))           # (B, T): V before each token


def load_value(path: str) -> ValueModel:
    """The critic in float32 master weights (see load_policy)."""
    from transformers import AutoModel
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
    return ValueModel(backbone, backbone.config.hidden_size)


def sharded(path: str, kind: str, world, dtype: str) -> nn.Module:
    """The trainer's models as both entrypoints build them: loaded (policy and value in float32
    master weights, the frozen reference in `dtype`), then FSDP2-sharded to compute in `dtype`
    (`--model.dtype`) on the world's device (dist.shard)."""
    from minirl import dist
    load = {"policy": load_policy, "value": load_value, "reference": lambda p: load_reference(p, dtype)}[kind]
    return dist.shard(load(path), world, DTYPES[dtype])


# ---- the chosen tokens' log-probabilities, without the full-vocabulary logits at once ----

LOGITS_CHUNK = 2**26  # vocabulary entries per piece: 256 MiB of float32 logits (441 tokens at vocab 151,936)


def token_logprobs(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token under `model`: (B, T) ids -> (B, T) float32.

    Column t holds log p(input_ids[:, t] | input_ids[:, :t]); column 0 has no context and is 0.
    Sequences are right-padded, so causal attention never lets a real token see a pad.

    Memory: a Hugging Face causal LM ends with `logits = self.lm_head(hidden)`, (B, T, V). At a
    real vocabulary (151,936) those logits plus their float32 log-softmax cost more than the
    model's activations, so for the length of this call `lm_head` is replaced by a head that
    returns only the chosen tokens' logprobs: it walks the tokens in pieces of LOGITS_CHUNK
    vocabulary entries, and under autograd each piece is recomputed in backward instead of kept.
    It runs inside the model's own forward, so FSDP2 has gathered the head's weight as usual.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(model.config, "final_logit_softcapping", None):  # logits post-processed
        return plain_token_logprobs(model, input_ids)
    name = next(n for n, m in model.named_children() if m is head)
    setattr(model, name, _ChosenLogprobs(head, input_ids[:, 1:]))
    try:
        lp = model(input_ids=input_ids).logits                          # (B, T): last column unused
    finally:
        setattr(model, name, head)
    return nn.functional.pad(lp[:, :-1], (1, 0))                        # (B, T)


def plain_token_logprobs(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The same numbers from the full logits and their float32 log-softmax (the reference; and the
    path for models whose logits are post-processed after `lm_head`)."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()          # (B, T-1, V)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return nn.functional.pad(lp, (1, 0))                                # (B, T)


class _ChosenLogprobs(nn.Module):
    """Stands in for `lm_head`: hidden (B, T, H) -> log p(targets) (B, T), the last column 0."""

    def __init__(self, head: nn.Module, targets: torch.Tensor):
        super().__init__()
        self.head, self.targets = head, targets                         # targets: (B, T-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        B, T, H = hidden.shape
        h = hidden[:, :-1].reshape(-1, H)                               # (N, H), N = B*(T-1)
        y = self.targets.reshape(-1)                                    # (N,)
        w, b = self.head.weight, self.head.bias
        step = max(1, LOGITS_CHUNK // w.shape[0])
        pieces = []
        for i in range(0, h.shape[0], step):
            args = (h[i:i + step], w, b, y[i:i + step])
            if torch.is_grad_enabled():
                pieces.append(checkpoint(_piece_logprobs, *args, use_reentrant=False))
            else:
                pieces.append(_piece_logprobs(*args))
        lp = torch.cat(pieces) if pieces else h.new_zeros(0, dtype=torch.float32)
        return nn.functional.pad(lp.view(B, T - 1), (0, 1))             # (B, T)


def _piece_logprobs(h, w, b, y):
    logits = nn.functional.linear(h, w, b).float()                      # (n, V)
    return logits.gather(-1, y[:, None]).squeeze(-1) - logits.logsumexp(-1)  # (n,)
