"""Policy, value and reference models, all loaded one way, and the chosen tokens' logprobs.

Contract: every model comes from a local Hugging Face folder, found and checked whole before anything
heavy is built (launch.resolve_path); the trainer and the vLLM engine then read the same folder. The
built-in task's model (`build_tiny`: a Qwen2 with a character-level tokenizer, no download, warm-started
roughly on the task) is built once into minirl's cache folder.

Shapes: B sequences, T tokens, V vocab.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minirl import batch
from minirl.batch import Layout
from minirl.config import ConfigError, TinyModelConfig
from minirl.tasks import warm_start


# ---- loading ----

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def quiet_load(report: bool = False):
    """A transformers load without its progress bar, and without its load report unless `report` (transformers'
    verbosity is put back after)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    if not report:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _pretrained(auto: str, path: str, dtype: torch.dtype) -> nn.Module:
    """A transformers `Auto*` class's model from `path`, for training: no dropout (the engine samples
    without it, and pi_old must be that policy: TRL's and OpenRLHF's disable_dropout), no KV cache (with
    one, packed rows would mix) and no progress bar per load on every rank. The folder holds every weight the
    model has (`check_folder`)."""
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    for key, value in config.to_dict().items():  # GPT-2's resid_pdrop, Qwen2's attention_dropout, ...
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    # the critic's backbone: the load report would list the LM head it leaves out by design
    with quiet_load(report=auto != "AutoModel"):
        model = getattr(transformers, auto).from_pretrained(path, config=config, dtype=dtype)
    model.config.use_cache = False
    # vLLM 0.32 serves some families (GPT-NeoX, OLMo 2, Phi) through its Transformers backend, which rewrites
    # their transformers base class in this process as the engine is built: its __call__ then reads
    # `do_not_compile`, which only vLLM's own instances are given, and an instance made after that fails (so
    # every loop builds its trainer first). The trainer's run as written.
    model.base_model.do_not_compile = True
    return model


def load_policy(path: str) -> nn.Module:
    """The policy in float32: its parameters are the optimizer's master weights (computing in --model.dtype)."""
    return _pretrained("AutoModelForCausalLM", path, torch.float32)


def load_reference(path: str, dtype: str = "float32") -> nn.Module:
    """The frozen starting policy for the KL penalty, stored in the compute dtype (it never steps)."""
    return _pretrained("AutoModelForCausalLM", path, DTYPES[dtype]).eval().requires_grad_(False)


class ValueModel(nn.Module):
    """The policy's backbone with a scalar head per token: (B, T) ids -> values (B, T).

    Column t is V of the prefix BEFORE token t, the state in which token t was chosen, so it lines up
    with `token_logprobs` column t (the action); read at t itself the baseline would see the action it
    judges. Column 0 is 0, and the head starts at zero."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone
        self.config = backbone.config  # its attention decides how packed rows are laid out (batch.one_lane)
        self.score = nn.Linear(hidden_size, 1, bias=True)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)

    def forward(self, input_ids: torch.Tensor, lengths=None) -> torch.Tensor:
        lay = layout(self, input_ids, lengths)                          # padding-free when it packs
        ids = lay.pack(input_ids) if lay else input_ids
        hidden = self.model(input_ids=ids, position_ids=lay.positions if lay else None).last_hidden_state
        v = value_head(hidden, self.score)                              # V after each token
        return _before(v, lay)                                          # (B, T): V before each token


def value_head(hidden: torch.Tensor, score: nn.Linear) -> torch.Tensor:
    """(B, T, H) -> (B, T), computed in float32 (a bf16 value keeps 8 bits of mantissa)."""
    return nn.functional.linear(*(wide(t) for t in (hidden, score.weight, score.bias))).squeeze(-1)


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 at least (a float64 test reference stays float64)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def load_value(path: str) -> ValueModel:
    """The critic in float32 master weights (see load_policy)."""
    backbone = _pretrained("AutoModel", path, torch.float32)
    return ValueModel(backbone, backbone.config.hidden_size)


# ---- the built-in task's model, built once into minirl's cache folder ----

def cache_dir() -> str:
    return os.environ.get("MINIRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "minirl"))


# The tiny tokenizer's alphabet: one token per character, plus the specials.
SPECIALS = ["<pad>", "<eos>", "<unk>"]
ALPHABET = list("0123456789abcdefghijklmnopqrstuvwxyz+-*=?:,.#()")  # no space: the char pre-tokenizer drops it


def build_tiny(shape: TinyModelConfig) -> str:
    """Write (once) and return the tiny model's folder. Safe to call from many ranks at once."""
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # a first run's stderr holds its errors only, not a save's progress bar

    key = hashlib.sha1(json.dumps([shape.__dict__, ALPHABET, 2]).encode()).hexdigest()[:10]
    path = os.path.join(cache_dir(), f"tiny-{key}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=".tiny-")
    except OSError as e:  # a read-only home (some clusters' compute nodes), a full disk
        raise ConfigError(f"the built-in model is built once into {cache_dir()}, which cannot be written "
                          f"({e.strerror}); set MINIRL_CACHE to a folder you can write") from e
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


# ---- the trainer's models ----

def sharded(path: str, kind: str, world, dtype: str, pack: bool = False, like: nn.Module | None = None,
            checkpointing: bool = False, temperature: float = 1.0) -> nn.Module:
    """The trainer's models as both loops build them: loaded (float32 masters; the reference in `dtype`),
    then FSDP2-sharded to compute in `dtype` on the world's device. Its logprobs are at the sampling
    `temperature` (`token_logprobs`). Before sharding, two checks on the float32 weights decide how the
    model computes: `pack` trains padding-free where the model keeps packed rows apart (`packing_error`),
    and the chunked logprob head is used where it equals the model's own logits (`chunked_head_error`);
    the reference takes the temperature and both verdicts from `like`."""
    load = {"policy": load_policy, "value": load_value, "reference": lambda p: load_reference(p, dtype)}[kind]
    model = load(path)
    model.temperature = like.temperature if like is not None else temperature
    if like is not None:
        model.pack_rows, model.chunked_head = like.pack_rows, like.chunked_head
    else:
        model.pack_rows = pack and packing_error(model) is None
        model.chunked_head = kind != "policy" or chunked_head_error(model) is None
    return shard_built(model, kind, world, dtype, checkpointing)


def shard_built(model: nn.Module, kind: str, world, dtype: str, checkpointing: bool) -> nn.Module:
    """The end of `sharded` for a model already built (the rehearsal builds its own on the meta device)."""
    from minirl import dist
    if checkpointing and kind != "reference":
        checkpoint_blocks(model)
    return dist.shard(model, world, DTYPES[dtype])


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing per decoder block: each block's own forward (not the block) recomputes in
    backward, so parameter names stay Hugging Face's and FSDP2's hooks stay outside the checkpoint
    (torchtitan's order). No-grad forwards run as before."""
    from minirl import dist
    for block in dist.decoder_blocks(model):
        block.forward = _recomputed(block.forward)
    return model


def _recomputed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


def load_report(asked: bool, policy: nn.Module) -> str:
    """The load checks' verdicts for the console: padding-free training, and a full-logits head."""
    if policy.pack_rows:
        line = "padding-free training: on (rows packed per micro-batch; --model.no-packing pads them)"
    elif asked:
        line = ("padding-free training: off: this model mixes rows packed into one sequence (its attention ignores "
                "restarting position_ids), so its micro-batches are padded")
    else:
        line = "padding-free training: off (--model.no-packing)"
    if not getattr(policy, "chunked_head", True):
        line += ("\nlogprob head: full logits: this model changes its logits after lm_head (a scale or a cap), so "
                 "the chunked head would be wrong; each micro-batch holds its (rows, tokens, vocab) logits")
    return line


def chunked_head_error(model: nn.Module) -> float | None:
    """None when the chunked head agrees with the model's own logits to 1e-4 nats on a few tokens, else the
    largest difference (a model that scales or caps its logits after `lm_head`: Granite, Cohere, Gemma 2)."""
    if model.get_output_embeddings() is None:
        return float("inf")
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        err = (_chunked_token_logprobs(model, ids, False, None) - plain_token_logprobs(model, ids)).abs().max().item()
    return None if err <= 1e-4 else err


def packing_error(model: nn.Module) -> float | None:
    """batch.exact on a float32 policy or critic: None when packed rows come out as alone."""
    backbone = model.model if isinstance(model, ValueModel) else model
    if batch.one_lane(backbone):  # flash kernels do not run on the host; transformers packs them by varlen
        return None

    def forward(ids, pos):
        out = backbone(input_ids=ids, position_ids=pos)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state

    return batch.exact(forward, backbone.config.vocab_size)


# ---- the chosen tokens' log-probabilities, without the full-vocabulary logits at once ----

LOGITS_CHUNK = 2**26  # vocabulary entries per piece: 256 MiB of float32 logits (441 tokens at vocab 151,936)


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, entropy: bool | str = False, lengths=None):
    """Log-probability of each next token under `model`: (B, T) ids -> (B, T) float32.

    Column t holds log p(input_ids[:, t] | input_ids[:, :t]) under the logits divided by the model's
    `temperature` (the distribution the engine samples, as verl and TRL score it); column 0 is 0.
    `entropy=True` also returns each position's entropy (B, T) without a gradient (a metric),
    `entropy="grad"` with it (a bonus).
    Given `lengths` (host ints) and a model that packs, the forward runs padding-free (batch.Layout).

    Memory: for the length of the call `lm_head` is replaced by a head that returns only the chosen
    tokens' logprobs, LOGITS_CHUNK vocabulary entries at a time and recomputed in backward: at a real
    vocabulary the (B, T, V) logits would cost more than the activations. It runs inside the model's own
    forward, so FSDP2 has gathered the head's weight as usual."""
    if not getattr(model, "chunked_head", True) or getattr(model.config, "final_logit_softcapping", None):
        return plain_token_logprobs(model, input_ids, entropy, lengths)  # logits post-processed (sharded's check)
    return _chunked_token_logprobs(model, input_ids, entropy, lengths)


def _chunked_token_logprobs(model: nn.Module, input_ids: torch.Tensor, entropy: bool | str, lengths):
    head = model.get_output_embeddings()
    lay = layout(model, input_ids, lengths)
    ids = lay.pack(input_ids) if lay else input_ids
    name = next(n for n, m in model.named_children() if m is head)
    setattr(model, name, _ChosenLogprobs(head, ids[:, 1:], entropy == "grad", getattr(model, "temperature", 1.0)))
    try:
        out = model(input_ids=ids, position_ids=lay.positions if lay else None).logits  # (., ., 2)
    finally:
        setattr(model, name, head)
    lp, ent = (_before(x, lay) for x in out.unbind(-1))                 # (B, T) each
    return (lp, ent if entropy == "grad" else ent.detach()) if entropy else lp


def plain_token_logprobs(model: nn.Module, input_ids: torch.Tensor, entropy: bool | str = False, lengths=None):
    """The same numbers from the full logits (the reference, and models whose logits are post-processed)."""
    lay = layout(model, input_ids, lengths)
    ids = lay.pack(input_ids) if lay else input_ids
    logits = wide(model(input_ids=ids, position_ids=lay.positions if lay else None).logits)
    temperature = getattr(model, "temperature", 1.0)
    if temperature != 1.0:  # the sampling distribution (1.0: untouched, bit for bit)
        logits = logits / temperature
    logsm = torch.log_softmax(logits[:, :-1], dim=-1)                   # (., T-1, V)
    lp = _before(nn.functional.pad(logsm.gather(-1, ids[:, 1:, None]).squeeze(-1), (0, 1)), lay)
    if not entropy:
        return lp
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        ent = -(logsm.exp() * logsm).sum(-1)                             # (., T-1)
    return lp, _before(nn.functional.pad(ent, (0, 1)), lay)


def layout(model: nn.Module, input_ids: torch.Tensor, lengths) -> Layout | None:
    """The batch's packed layout, or None to run it padded (no packing, no lengths, or nothing to save)."""
    if lengths is None or not getattr(model, "pack_rows", False):
        return None
    rows = _ints(lengths)
    if computed_tokens(model, rows) >= input_ids.numel():
        return None
    return Layout.of(rows, input_ids.shape[1], batch.one_lane(model)).to(input_ids.device)


def _ints(lengths) -> list[int]:
    return lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """Fused AdamW over the float32 masters (one kernel for every parameter; FSDP2's DTensors take it)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


def computed_tokens(model: nn.Module, lengths: list[int]) -> int:
    """Tokens a forward of rows this long computes (columns trimmed to the longest): the packed lanes', one
    lane's under flash attention, or padded. A token budget's micro-batches are planned by it."""
    if not getattr(model, "pack_rows", False):
        return batch.padded_tokens(lengths)
    return sum(lengths) if batch.one_lane(model) else batch.computed_tokens(lengths)


def _before(x: torch.Tensor, lay: Layout | None) -> torch.Tensor:
    """Outputs at each token (predicting the next) -> at the token they predict: column t holds t-1's, column 0 is 0."""
    shifted = nn.functional.pad(x[:, :-1], (1, 0))
    return lay.unpack(shifted) if lay else shifted


class _ChosenLogprobs(nn.Module):
    """Stands in for `lm_head`: hidden (B, T, H) -> (B, T, 2), the chosen token's log-probability and
    the distribution's entropy; the last position (no next token) is 0."""

    def __init__(self, head: nn.Module, targets: torch.Tensor, entropy_grad: bool, temperature: float):
        super().__init__()
        self.head, self.targets, self.entropy_grad = head, targets, entropy_grad  # targets: (B, T-1)
        self.temperature = temperature

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        B, T, H = hidden.shape
        h, bias = hidden[:, :-1].reshape(-1, H), self.head.bias         # (N, H), N = B*(T-1)
        if self.temperature != 1.0:  # (h W^T + b) / t = (h / t) W^T + b / t: no copy of the (V, H) weight
            h, bias = h / self.temperature, bias / self.temperature if bias is not None else None
        step = max(1, LOGITS_CHUNK // self.head.weight.shape[0])
        both = _ChunkedHead.apply(h, self.head.weight, bias, self.targets.reshape(-1), step,
                                  self.entropy_grad)                    # (N, 2)
        return nn.functional.pad(both.view(B, T - 1, 2), (0, 0, 0, 1))  # (B, T, 2)


class _ChunkedHead(torch.autograd.Function):
    """(N, H) hidden, the head's weight and bias, (N,) targets -> (N, 2) float32 [logprob, entropy], `step`
    tokens at a time. Backward recomputes each piece's logits and sums the weight gradient in float32
    (per-piece bf16 sums would round at every piece). `entropy_grad`: dH/dz = -p (log p + H) flows too."""

    @staticmethod
    def forward(ctx, h, w, b, y, step: int, entropy_grad: bool):
        ctx.save_for_backward(h, w, b, y)
        ctx.step, ctx.entropy_grad = step, entropy_grad
        pieces = [_piece_logprobs(h[i:i + step], w, b, y[i:i + step]) for i in range(0, h.shape[0], step)]
        return torch.cat(pieces) if pieces else h.new_zeros(0, 2, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        h, w, b, y = ctx.saved_tensors
        g = grad[:, 0]                                                  # (N,) d loss / d logprob
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=torch.promote_types(w.dtype, torch.float32), device=w.device)
        db = torch.zeros_like(dw[:, 0]) if b is not None else None
        for i in range(0, h.shape[0], ctx.step):
            hp, yp, gp = h[i:i + ctx.step], y[i:i + ctx.step], g[i:i + ctx.step]
            logits = _float_mm(hp, w.t()) + (wide(b) if b is not None else 0)   # (n, V) float32
            p = torch.softmax(logits, -1)
            d = -p * gp[:, None]                                                 # d logprob / d logit:
            d[torch.arange(len(yp), device=d.device), yp] += gp                  # one-hot minus softmax
            if ctx.entropy_grad:
                logp = logits - logits.logsumexp(-1, keepdim=True)
                d -= p * (logp - (p * logp).sum(-1, keepdim=True)) * grad[i:i + ctx.step, 1:]  # dH/dz
            d_in = d.to(h.dtype)
            dh[i:i + ctx.step] = d_in @ w
            dw += _float_mm(d_in.t(), hp)                               # (V, H), summed in float32
            if db is not None:
                db += d.sum(0)
        return dh, dw.to(w.dtype), db.to(b.dtype) if db is not None else None, None, None, None


def _piece_logprobs(h, w, b, y):
    logits = _float_mm(h, w.t())                                        # (n, V) float32
    if b is not None:
        logits = logits + wide(b)
    lse = logits.logsumexp(-1)                                          # (n,)
    lp = logits.gather(-1, y[:, None]).squeeze(-1) - lse                # (n,)
    ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)            # (n,): H = lse - E[logit]
    return torch.stack([lp, ent], -1)                                   # (n, 2)


def _float_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 result from compute-dtype inputs (a bf16 logit keeps 8 bits of mantissa);
    `out_dtype` on CUDA, a cast elsewhere."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.device.type == "cuda":
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except NotImplementedError:  # a torch without the CUDA kernel: cast, as on the host
            pass
    return wide(a) @ wide(b)
