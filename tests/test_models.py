"""models.py: the chosen tokens' logprobs without the full-vocabulary logits of the whole micro-batch
(equal to the plain log-softmax path, values and gradients)."""

import json
import os

import pytest
import torch

from conftest import assert_same_grads, grads
from minirl import dist, launch, models, rollout


def big_vocab_model(vocab=151_936, hidden=8):
    """A one-layer Qwen2 at a real vocabulary and a tiny width, so the logits dwarf everything else."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True, use_cache=False)
    return Qwen2ForCausalLM(cfg)


def close(plain: torch.Tensor, chunked: torch.Tensor) -> bool:
    """Equal up to float32 rounding: 1e-6 of the largest magnitude (a logprob of -8 has an ulp of 1e-6)."""
    return (plain - chunked).abs().max().item() < 1e-6 * plain.abs().max().clamp_min(1).item()


@pytest.mark.parametrize("fsdp", [False, True])
def test_chunked_logprobs_equal_the_plain_log_softmax(tiny_path, world, monkeypatch, fsdp):
    monkeypatch.setattr(models, "LOGITS_CHUNK", 7 * 50)  # several pieces of 7 tokens at the tiny vocabulary
    a, b = models.load_policy(tiny_path), models.load_policy(tiny_path)
    if fsdp:
        a, b = dist.shard(a, world, torch.float32), dist.shard(b, world, torch.float32)
    ids = torch.randint(3, 40, (3, 11), generator=torch.Generator().manual_seed(0))
    w = torch.rand(3, 11, generator=torch.Generator().manual_seed(1))
    plain, chunked = models.plain_token_logprobs(a, ids), models.token_logprobs(b, ids)
    assert close(plain, chunked) and chunked[:, 0].eq(0).all()
    (plain * w).sum().backward()
    (chunked * w).sum().backward()
    assert_same_grads(grads(b), grads(a))


@pytest.mark.parametrize("B,T", [(1, 2), (1, 8), (2, 5), (3, 6)], ids=["one", "a-piece", "a-piece+1", "two+1"])
def test_chunked_logprobs_equal_the_plain_path_at_every_piece_boundary(tiny_path, monkeypatch, B, T):
    """Pieces of 7 tokens; B*(T-1) tokens = 1, exactly one piece, a piece and one, two pieces and one:
    every token is scored once (values and gradients), none dropped at a piece's edge."""
    vocab = models.load_policy(tiny_path).config.vocab_size
    monkeypatch.setattr(models, "LOGITS_CHUNK", 7 * vocab)
    a, b = models.load_policy(tiny_path), models.load_policy(tiny_path)
    ids = torch.randint(3, 40, (B, T), generator=torch.Generator().manual_seed(B * 10 + T))
    plain, chunked = models.plain_token_logprobs(a, ids), models.token_logprobs(b, ids)
    assert chunked.shape == plain.shape == (B, T) and close(plain, chunked)
    plain.sum().backward()
    chunked.sum().backward()
    assert_same_grads(grads(b), grads(a))


def test_one_token_rows_have_no_next_token_to_score(tiny_path):
    lp, ent = models.token_logprobs(models.load_policy(tiny_path), torch.tensor([[3], [4]]), entropy=True)
    assert lp.shape == ent.shape == (2, 1) and not lp.any() and not ent.any()


def test_a_head_with_a_bias_adds_it_in_every_piece_and_sums_its_gradient(tiny_path, monkeypatch):
    """An lm_head with a bias (Phi's, GPT-J's): the chunked head adds it to each piece's logits, and its
    gradient comes out as the plain path's."""
    def biased_policy():
        model = models.load_policy(tiny_path)
        head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.copy_(torch.randn(head.bias.shape, generator=torch.Generator().manual_seed(0)))
        model.lm_head = head
        return model
    a, b = biased_policy(), biased_policy()
    monkeypatch.setattr(models, "LOGITS_CHUNK", 7 * a.config.vocab_size)  # pieces of 7 tokens
    ids = torch.randint(3, 40, (3, 6), generator=torch.Generator().manual_seed(0))
    plain, chunked = models.plain_token_logprobs(a, ids), models.token_logprobs(b, ids)
    assert close(plain, chunked)
    plain.sum().backward()
    chunked.sum().backward()
    assert a.lm_head.bias.grad.abs().max() > 0
    assert close(a.lm_head.bias.grad, b.lm_head.bias.grad) and close(a.lm_head.weight.grad, b.lm_head.weight.grad)


def test_both_heads_score_the_distribution_at_the_models_temperature_values_and_gradients(tiny_path, monkeypatch):
    """A model sharded for --rollout.temperature t scores log softmax(logits / t), as verl and TRL do: the chunked
    head (with a bias, in pieces) and the plain path agree with it, entropy too, and so do their gradients (in
    float64, as the entropy tests below: the heads sum in different orders)."""
    def tempered():
        model = models.load_policy(tiny_path).double()
        head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True, dtype=torch.float64)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.copy_(torch.randn(head.bias.shape, generator=torch.Generator().manual_seed(0)))
        model.lm_head, model.temperature = head, 0.5
        return model
    a, b = tempered(), tempered()
    monkeypatch.setattr(models, "LOGITS_CHUNK", 7 * a.config.vocab_size)  # pieces of 7 tokens
    ids = torch.randint(3, 40, (3, 6), generator=torch.Generator().manual_seed(0))
    logsm = torch.log_softmax(a(input_ids=ids).logits[:, :-1].detach() / 0.5, -1)
    by_hand = [torch.nn.functional.pad(x, (1, 0)) for x in (logsm.gather(-1, ids[:, 1:, None]).squeeze(-1),
                                                             -(logsm.exp() * logsm).sum(-1))]
    plain, chunked = models.plain_token_logprobs(a, ids, entropy="grad"), models.token_logprobs(b, ids, entropy="grad")
    for x, y, z in zip(by_hand, plain, chunked):
        assert (x - y).abs().max().item() < 1e-10 and (x - z).abs().max().item() < 1e-10
    (plain[0].sum() + plain[1].sum()).backward()
    (chunked[0].sum() + chunked[1].sum()).backward()
    assert max((p.grad - q.grad).abs().max().item() for p, q in zip(a.parameters(), b.parameters())) < 1e-10
    assert a.lm_head.bias.grad.abs().max().item() > 1e-6


def test_the_reference_and_an_entropy_metric_stay_out_of_the_graph(tiny_path):
    ref = models.load_reference(tiny_path)
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    lp, ent = models.plain_token_logprobs(models.load_policy(tiny_path), torch.tensor([[3, 4, 5]]), entropy=True)
    assert lp.requires_grad and not ent.requires_grad  # entropy=True: a metric, outside the graph


def scaled_logits_model(tmp_path, arch):
    """A one-layer model of an architecture that changes its logits after lm_head, saved as a folder."""
    import transformers
    torch.manual_seed(0)
    config_cls, model_cls, scale = {"granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
                                    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.25})}[arch]
    cfg = getattr(transformers, config_cls)(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                            num_attention_heads=1, num_key_value_heads=1, bos_token_id=1,
                                            eos_token_id=2, pad_token_id=0, **scale)
    getattr(transformers, model_cls)(cfg).save_pretrained(tmp_path / arch)
    return str(tmp_path / arch)


@pytest.mark.parametrize("arch", ["granite", "cohere"])
def test_models_that_scale_their_logits_get_their_own_logprobs(tmp_path, world, arch):
    """Granite divides its logits by logits_scaling and Cohere multiplies them by logit_scale, after
    lm_head: the chunked head, which replaces lm_head, would miss that (a Granite with scaling 4 was
    up to 2.9 nats off). The load check finds it, the policy (and a reference built like it) are
    scored from their full logits, and the console says so; the tiny Qwen2 keeps the chunked head."""
    path = scaled_logits_model(tmp_path, arch)
    policy = models.sharded(path, "policy", world, "float32")
    ref = models.sharded(path, "reference", world, "float32", like=policy)
    assert not policy.chunked_head and not ref.chunked_head
    assert "logprob head: full logits" in models.load_report(True, policy)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = torch.log_softmax(policy(input_ids=ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])
        got = models.token_logprobs(policy, ids)
    assert (got[:, 1:] - own.squeeze(-1)).abs().max().item() < 1e-5


def test_a_slight_scale_after_the_head_is_caught_too(tmp_path):
    """Granite with logits_scaling 1.01: off by far less than a nat, still past the check's 1e-4."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GraniteConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=1, num_key_value_heads=1, logits_scaling=1.01)
    err = models.chunked_head_error(transformers.GraniteForCausalLM(cfg))
    assert err is not None and 1e-4 < err < 0.5


def test_the_tiny_model_keeps_the_chunked_head(tiny_path, world):
    policy = models.sharded(tiny_path, "policy", world, "float32")
    assert policy.chunked_head and "logprob head" not in models.load_report(True, policy)


def test_no_full_vocabulary_logits_for_the_whole_micro_batch(monkeypatch):
    """At vocab 151,936 the largest tensor made in forward and backward is one piece of logits, not
    (B, T, V); the plain path makes several of those."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat, _ = tree_flatten(out)
            self.numel = max([self.numel] + [t.numel() for t in flat if isinstance(t, torch.Tensor)])
            return out

    model = big_vocab_model()
    V, B, T = model.config.vocab_size, 2, 64
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(models, "LOGITS_CHUNK", 16 * V)  # 16 tokens of logits per piece
    params = max(p.numel() for p in model.parameters())  # the embedding (and its gradient): V x hidden
    seen = {}
    for name, fn in (("plain", models.plain_token_logprobs), ("chunked", models.token_logprobs)):
        with Largest() as largest:
            fn(model, ids).sum().backward()
        seen[name] = largest.numel
        model.zero_grad()
    assert seen["plain"] >= B * (T - 1) * V
    assert seen["chunked"] <= max(16 * V, params)


def copy_of(tiny_path, tmp_path):
    import shutil
    d = tmp_path / "model"
    shutil.copytree(tiny_path, d)
    return d


def test_a_garbage_config_json_is_refused_naming_the_file(tiny_path, tmp_path):
    from minirl.config import ConfigError, ModelConfig
    d = copy_of(tiny_path, tmp_path)
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match=rf"{d}/config\.json is not valid JSON"):
        launch.resolve_path(ModelConfig(path=str(d)))


def test_a_truncated_safetensors_file_is_found_before_loading(tiny_path, tmp_path):
    import os
    from minirl.config import ConfigError, ModelConfig
    d = copy_of(tiny_path, tmp_path)
    f = d / "model.safetensors"
    assert launch.resolve_path(ModelConfig(path=str(d))) == str(d)  # whole: its last byte is its last tensor's
    whole = os.path.getsize(f)
    os.truncate(f, whole - 1)
    with pytest.raises(ConfigError, match=rf"{f} is truncated \({whole - 1} bytes of {whole}\)"):
        launch.resolve_path(ModelConfig(path=str(d)))
    os.truncate(f, os.path.getsize(f) - 1000)
    with pytest.raises(ConfigError, match=rf"{f} is truncated"):
        launch.resolve_path(ModelConfig(path=str(d)))
    header = int.from_bytes(f.read_bytes()[:8], "little")
    os.truncate(f, 8 + header - 1)  # the JSON header itself one byte short
    with pytest.raises(ConfigError, match=r"not a readable safetensors file \(header cut short\)"):
        launch.resolve_path(ModelConfig(path=str(d)))
    os.truncate(f, 4)
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        launch.resolve_path(ModelConfig(path=str(d)))
    f.write_bytes(bytes(8) + b"{}")  # a header length of 0
    with pytest.raises(ConfigError, match=r"not a readable safetensors file \(header cut short\)"):
        launch.resolve_path(ModelConfig(path=str(d)))
    from safetensors.torch import save_file
    save_file({}, str(f))  # no tensors: the header is the whole file, and that is whole (the folder lacks weights)
    assert os.path.getsize(f) == 8 + int.from_bytes(f.read_bytes()[:8], "little")
    with pytest.raises(ConfigError, match=r"lacks \d+ weight\(s\) of its model \([\w.]+, [\w.]+, [\w.]+, \.\.\.\), "):
        launch.resolve_path(ModelConfig(path=str(d)))


def test_a_model_folder_that_lacks_a_weight_or_holds_one_of_another_shape_is_refused_naming_it(tiny_path, tmp_path):
    """transformers loads a folder that lacks a weight with that weight at random and a warning, and vLLM
    serves the missing half of a weight it fuses (gate with up) as whatever memory held: `minirl-eval`
    scored such a folder. The folder check refuses it, naming the weight, before any model is built; and
    a config.json of another size than the weights, naming the weight and both shapes. A quantized model's
    weights are named by its quantizer (`minirl-eval` scores one with vLLM): not read here."""
    from safetensors.torch import load_file, save_file
    from minirl.config import ConfigError, ModelConfig
    weights = load_file(os.path.join(tiny_path, "model.safetensors"))
    for i, end in enumerate(["layers.1.mlp.down_proj.weight", "layers.1.mlp.up_proj.weight"]):
        d = copy_of(tiny_path, tmp_path / str(i))
        gone = next(k for k in weights if k.endswith(end))
        save_file({k: v for k, v in weights.items() if k != gone}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
        with pytest.raises(ConfigError, match=rf"--model.path: {d} lacks 1 weight\(s\) of its model \({gone}\), "
                                              "which would start at random"):
            launch.resolve_path(ModelConfig(path=str(d)))
    d = copy_of(tiny_path, tmp_path / "wider")
    config = json.loads((d / "config.json").read_text())
    width = config["intermediate_size"]
    (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 2 * width}))
    hidden = config["hidden_size"]
    with pytest.raises(ConfigError, match=rf"--model.path: {d} holds {3 * config['num_hidden_layers']} weight\(s\) of "
                                          rf"another shape than its config.json gives \(model\.layers\.0\.mlp\.down_proj"
                                          rf"\.weight: \({hidden}, {width}\), where the model has \({hidden}, {2 * width}\)\)"):
        launch.resolve_path(ModelConfig(path=str(d)))
    quantized = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}  # names its quantizer's
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": quantized}))
    assert launch.resolve_path(ModelConfig(path=str(d))) == str(d)  # for vLLM to read (transformers needs gptqmodel)


def test_the_critic_loads_an_untied_models_backbone_without_a_report_on_the_head_it_leaves(moe_paths, capfd, caplog):
    """The critic is the checkpoint's backbone: the LM head of an untied model is left out by design, and
    transformers' load report of it (a table, on every train rank) said nothing a user could act on."""
    from transformers.utils import logging as hf_logging
    path = moe_paths["qwen3_moe"]
    assert "lm_head.weight" in models.load_policy(path).state_dict()  # untied: a head of its own in the files
    capfd.readouterr()
    caplog.clear()
    verbosity = hf_logging.get_verbosity()
    value = models.load_value(path)
    assert "LOAD REPORT" not in "".join(capfd.readouterr()) + caplog.text
    assert hf_logging.get_verbosity() == verbosity  # the quiet is the critic's load's only
    assert isinstance(value, models.ValueModel)


def test_a_hub_like_name_that_is_no_local_folder_says_both(monkeypatch, tmp_path):
    from minirl.config import ConfigError, ModelConfig
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"there is no local folder of that name, and as a hub name it could not "
                                          r"be fetched"):
        launch.resolve_path(ModelConfig(path="runs/final"))
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise OSError("x" * 200 + "\nsecond line")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ConfigError) as e:  # the hub's reason: its first line, cut at 160 characters
        launch.resolve_path(ModelConfig(path="runs/final"))
    assert f"could not be fetched (OSError: {'x' * 160}); give an existing" in str(e.value)


def test_a_model_path_is_a_folder_a_fetched_hub_name_or_refused_naming_both(monkeypatch, tmp_path, tiny_path):
    """Neither a folder nor shaped like a hub name (`owner/name`): refused at once. A hub name fetches only the
    files a model needs, and the folder it lands in is checked like a local one."""
    from minirl.config import ConfigError, ModelConfig
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--model.path='no-such-folder' does not exist; give a local model folder, "
                                          r"a hub name like Qwen/Qwen2.5-0.5B-Instruct, or `tiny` for the built-in"):
        launch.resolve_path(ModelConfig(path="no-such-folder"))
    import huggingface_hub
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda name, **kw: asked.append((name, kw)) or tiny_path)
    assert launch.resolve_path(ModelConfig(path="owner/model")) == tiny_path
    assert asked == [("owner/model", {"allow_patterns": ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]})]
    checked = []
    monkeypatch.setattr(launch, "check_folder", checked.append)
    launch.resolve_path(ModelConfig(path="owner/model"))
    assert checked == [tiny_path]


def test_entropy_from_the_chunked_head_equals_the_full_distributions(tiny_path, monkeypatch):
    """In float64. The two heads sum in different orders: each logit is a dot product of H terms, each
    log-sum-exp a sum of V, so float32 rounding alone may part them by about 2(gamma_H S + gamma_V)
    with gamma_n = n 2^-24 and S = max |h|.|w| (~1e-5 at H = 128, V = 50: a 1e-6 tolerance failed on
    other machines). In float64 the same bound is ~1e-13, so the check can be tight everywhere."""
    monkeypatch.setattr(models, "LOGITS_CHUNK", 5 * 50)
    model = models.load_policy(tiny_path).double()
    ids = torch.randint(3, 40, (3, 9), generator=torch.Generator().manual_seed(2))
    lp, ent = models.token_logprobs(model, ids, entropy=True)
    lp_ref, ent_ref = models.plain_token_logprobs(model, ids, entropy=True)
    assert lp.dtype == ent.dtype == torch.float64
    assert (lp - lp_ref).abs().max().item() < 1e-10 and (ent - ent_ref).abs().max().item() < 1e-10
    assert not ent.requires_grad and (ent[:, 1:] > 0).all() and (ent[:, 0] == 0).all()


def test_the_entropy_bonus_gradient_through_the_chunked_head_equals_the_full_distributions(tiny_path, monkeypatch):
    """entropy="grad": the chunked head's backward adds dH/dz = -p (log p + H) per piece; a loss of
    logprobs and entropies gives the plain head's gradients (in float64, as above)."""
    monkeypatch.setattr(models, "LOGITS_CHUNK", 5 * 50)
    ids = torch.randint(3, 40, (3, 9), generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (models.token_logprobs, models.plain_token_logprobs):
        model = models.load_policy(tiny_path).double()
        lp, ent = fn(model, ids, entropy="grad")
        (lp.sum() + 0.7 * ent.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert max((a - b).abs().max().item() for a, b in zip(*grads)) < 1e-10
    model = models.load_policy(tiny_path).double()
    _, ent = models.token_logprobs(model, ids, entropy="grad")
    ent.sum().backward()  # the entropy alone trains the head: its gradient is not dropped
    assert model.get_output_embeddings().weight.grad.abs().max().item() > 1e-6


@pytest.mark.parametrize("broken, says", [
    (lambda d: os.remove(d / "config.json"), "has no config.json: not a Hugging Face model folder"),
    (lambda d: (d / "config.json").write_text("{}"), "names no model_type"),
    (lambda d: [os.remove(d / n) for n in os.listdir(d) if n.startswith(("tokenizer", "vocab", "special", "merges"))],
     "has no tokenizer"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "foo", "auto_map": {}})),
     r"names model_type 'foo', which this transformers cannot load as a causal language model"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": [
        "Qwen2ForSequenceClassification"]})), "is a Qwen2ForSequenceClassification, a model that does not generate"),
    (lambda d: os.remove(d / "model.safetensors"), r"has no weights \(no \*\.safetensors file\)"),
    (lambda d: (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "lm_head.weight": "model-00002-of-00002.safetensors", "norm.weight": "model.safetensors"}})),
     r"model\.safetensors\.index\.json names 1 shard\(s\) the folder lacks "
     r"\(model-00002-of-00002\.safetensors, \.\.\.\)"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{}"), r"is not a readable shard index \(KeyError"),
])
def test_a_model_folder_without_a_causal_model_a_tokenizer_or_its_weights_is_refused_before_loading(
        tiny_path, tmp_path, broken, says):
    """A config.json of `{}`, a model_type of remote code, a reward model, a folder without tokenizer files, without
    weights or missing a shard: one line naming the folder, before any load (they used to fail deep in
    transformers, or at step 0 with "The decoder prompt cannot be empty" or vLLM's "only for generative models")."""
    from minirl.config import ConfigError, ModelConfig
    d = copy_of(tiny_path, tmp_path)
    broken(d)
    with pytest.raises(ConfigError, match=says):
        launch.resolve_path(ModelConfig(path=str(d)))


@pytest.mark.parametrize("kind", ["policy", "value"])
def test_activation_checkpointing_keeps_the_gradients_and_saves_only_block_inputs(tiny_path, world, kind):
    """--model.activation-checkpointing: the same loss and gradients to float tolerance (float32, FSDP2),
    while the forward keeps far less for backward (a checkpointed block saves its inputs only)."""
    from torch.distributed.tensor import DTensor
    ids = torch.randint(3, 40, (4, 24), generator=torch.Generator().manual_seed(0))
    runs = {}
    for ac in (False, True):  # off unless asked for: the first model is built with the default
        built = dict(checkpointing=True) if ac else {}
        model = models.sharded(tiny_path, kind, world, "float32", **built)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            out = models.token_logprobs(model, ids) if kind == "policy" else model(ids)
        (out.square().sum() if kind == "value" else out.sum()).backward()
        full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
        runs[ac] = (out.detach(), [full(p.grad) for p in model.parameters()], sum(saved))
    (out0, grads0, saved0), (out1, grads1, saved1) = runs[False], runs[True]
    assert torch.allclose(out0, out1, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(grads0, grads1))
    assert saved1 < 0.25 * saved0, (saved0, saved1)


@pytest.mark.parametrize("kind", ["reference", "value"])
def test_no_root_parameter_stays_gathered_after_a_forward_without_autograd(tiny_path, world, kind):
    """FSDP2 keeps the root's parameters (embedding, head) unsharded after its forward, for the backward
    that follows; the reference's and the critic's no-grad forwards have none, so minirl reshards."""
    from torch.distributed.tensor import DTensor
    model = models.sharded(tiny_path, kind, world, "float32")
    ids = torch.randint(3, 40, (2, 8))
    with torch.no_grad():
        models.token_logprobs(model, ids) if kind == "reference" else model(ids)
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert plain == []


def test_the_chunked_heads_weight_gradient_is_summed_over_its_pieces_in_float32():
    """bf16 compute, 512 pieces of 4 tokens: the head's weight gradient, summed over the pieces in float32
    and cast once, is within a bf16 rounding of the exact gradient (float64 from the same bf16 inputs);
    a bf16 running sum over the pieces (autograd's, when each piece was its own checkpoint) is not."""
    g = torch.Generator().manual_seed(0)
    N, H, V, step = 2048, 64, 512, 4
    h = torch.randn(N, H, generator=g).bfloat16().requires_grad_()
    w = (0.3 * torch.randn(V, H, generator=g)).bfloat16().requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(N, generator=g)
    (models._ChunkedHead.apply(h, w, None, y, step, False)[:, 0] * adv).sum().backward()
    p = torch.softmax(h.detach().double() @ w.detach().double().t(), -1)
    d = (torch.nn.functional.one_hot(y, V).double() - p) * adv.double()[:, None]  # d loss / d logit, (N, V)
    exact = d.t() @ h.detach().double()                                             # (V, H)
    scale = exact.abs().max().item()
    err = (w.grad.double() - exact).abs().max().item() / scale
    running = torch.zeros(V, H, dtype=torch.bfloat16)
    for i in range(0, N, step):  # per-piece products, each rounded to bf16, added up in bf16
        running += (d[i:i + step].t().bfloat16().float() @ h.detach()[i:i + step].float()).bfloat16()
    err_bf16_sum = (running.double() - exact).abs().max().item() / scale
    assert w.grad.dtype == torch.bfloat16 and err <= 2**-7 < err_bf16_sum, (err, err_bf16_sum)
    assert (h.grad.double() - d.bfloat16().double() @ w.detach().double()).abs().max() <= 2**-7 * h.grad.abs().max()


def test_bf16_compute_logprobs_and_values_come_out_of_their_heads_in_float32(tiny_path, world, monkeypatch):
    """The chunked head's logits and the critic's value head leave their matmuls in float32: from bf16
    hidden states and weights the chosen tokens' logprobs (vocab 4096) and the values equal the exact
    products' to 1e-4, where a bf16 result (the old heads) misses by 1e-2. Through the tiny model in bf16
    compute, the logprobs land closer to the float32 model's than with the old head."""
    from torch import nn
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(64, 64, generator=g).bfloat16(), (0.5 * torch.randn(4096, 64, generator=g)).bfloat16()
    y = torch.randint(0, 4096, (64,), generator=g)
    exact = torch.log_softmax(h.double() @ w.double().t(), -1).gather(-1, y[:, None]).squeeze(-1)
    rounded = nn.functional.linear(h, w).float()
    old = rounded.gather(-1, y[:, None]).squeeze(-1) - rounded.logsumexp(-1)
    new = models._piece_logprobs(h, w, None, y)[:, 0]
    assert (new.double() - exact).abs().max() < 1e-4 < 1e-2 < (old.double() - exact).abs().max()

    score = nn.Linear(64, 1).bfloat16()
    with torch.no_grad():  # from the test's generator, not the global one (other tests move that)
        score.weight.copy_(torch.randn(1, 64, generator=g) / 8)
        score.bias.copy_(torch.randn(1, generator=g) / 8)
    hidden = 4 * torch.randn(2, 32, 64, generator=g).bfloat16()
    exact = (hidden.double() @ score.weight.double().t() + score.bias.double()).squeeze(-1)
    new, old = models.value_head(hidden, score), score(hidden).squeeze(-1).float()
    assert (new.double() - exact).abs().max() < 1e-4 < 1e-2 < (old.double() - exact).abs().max()

    ids = torch.randint(3, 40, (4, 16), generator=g)
    with torch.no_grad():
        target = models.token_logprobs(models.sharded(tiny_path, "policy", world, "float32"), ids)
        policy = models.sharded(tiny_path, "policy", world, "bfloat16")
        err_new = (models.token_logprobs(policy, ids) - target).abs().mean()
        monkeypatch.setattr(models, "_float_mm", lambda a, b: (a @ b).float())  # a bf16 result, cast after
        err_old = (models.token_logprobs(policy, ids) - target).abs().mean()
    assert err_new < err_old, (err_new, err_old)


def test_another_familys_blocks_are_sharded_and_the_trainer_runs_without_its_dropout(tiny_path, gpt2_path, world):
    """A model of other names (GPT-2: `transformer.h` of GPT2Block, dropout 0.1 by default) loads as the Qwen2s do:
    each block sharded (and checkpointed) on its own, found by transformers' `_no_split_modules` (the loader
    looked for `model.layers` and failed on GPT-2), and no dropout in train() (the engine samples without it:
    pi_old and the ratio were of a policy never sampled, 0.04 nats off the engine's logprobs at the same weights)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    for path, block in ((gpt2_path, GPT2Block), (tiny_path, Qwen2DecoderLayer)):
        for kind in ("policy", "value"):
            model = models.sharded(path, kind, world, "float32", checkpointing=True)
            blocks = dist.decoder_blocks(model)
            assert len(blocks) == 2 and all(isinstance(b, block) and b.forward.__name__ == "run" for b in blocks)
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    for model in (models.load_policy(gpt2_path), models.load_value(gpt2_path)):
        assert all(v == 0.0 for k, v in model.config.to_dict().items() if "pdrop" in k)
        model.train()
        with torch.no_grad():
            out = [model(input_ids=ids) for _ in range(2)]
        first, second = (o if torch.is_tensor(o) else o.logits for o in out)
        assert torch.equal(first, second)
    assert json.load(open(os.path.join(gpt2_path, "config.json")))["resid_pdrop"] == 0.1  # the folder keeps its own


def test_the_weights_a_trainer_sends_and_exports_are_its_checkpoint_files_own(tiny_path, moe_paths):
    """transformers 5 loads a mixture of experts fused (each block's experts as one (experts, ...) parameter) and
    Mixtral's `block_sparse_moe` as `mlp`; vLLM reads the files' names and layout (a Mixtral weight sync failed
    with "There is no module or parameter named 'layers.0.mlp'", and its export did not load in vLLM). What the
    trainer sends and exports is the files' own tensors, name for name and bit for bit, reverted by the model or
    by the engine's meta-device copy of it alike, one parameter at a time; a dense model's pass unchanged."""
    from safetensors.torch import load_file
    for path in (tiny_path, *moe_paths.values()):
        policy = models.load_policy(path)
        files = load_file(os.path.join(path, "model.safetensors"))
        named = [(name, p.detach()) for name, p in policy.named_parameters()]
        if path != tiny_path:
            assert any(".experts.gate_up_proj" in name for name, _ in named)  # fused in memory
        for like in (policy, rollout.meta_model(path)):
            sent = dict(rollout.as_checkpoint(like, named))
            assert sorted(sent) == sorted(files), path
            assert all(torch.equal(sent[name], files[name]) for name in files), path
        taken = []  # streamed: the first pair goes out before the second parameter is gathered
        next(rollout.as_checkpoint(policy, (taken.append(name) or (name, t) for name, t in named)))
        assert len(taken) == 1, path


def test_every_familys_weights_are_sent_as_save_pretrained_writes_them():
    """For every causal-LM family this transformers builds (on the meta device, at two layers), the weight sync's
    pairs are the ones save_pretrained would write, names and shapes: one parameter at a time where each load-time
    conversion made one parameter (a fused mixture of experts, a rename), all at once where a load splits a tensor
    of the files into several (HRM's `gate_up_proj`, which one parameter at a time sent as half of itself)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    reverted = set()
    for family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = AutoConfig.for_model(family)
            text = config.get_text_config()
            for key in ("num_hidden_layers", "n_layer", "num_layers"):
                if isinstance(getattr(text, key, None), int):
                    setattr(text, key, min(getattr(text, key), 2))
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except Exception:  # a family this transformers cannot build from its default config
            continue
        named = {name: p.detach() for name, p in model.named_parameters()}
        whole = {name: t.shape for name, t in revert_weight_conversion(model, dict(named)).items()}
        assert {name: t.shape for name, t in rollout.as_checkpoint(model, iter(named.items()))} == whole, family
        if sorted(whole) != sorted(named):
            reverted.add(family)
    assert {"mixtral", "qwen3_moe", "deepseek_v2", "olmoe", "hrm_text"} <= reverted
    assert not reverted & {"llama", "qwen2", "qwen3", "gemma2", "gpt2"}
