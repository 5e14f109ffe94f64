"""The command layer: flags in, every check before a loop starts, an exit code out.

- `preflight(cls, argv, loop)`: the flags and `--config` (flags.py), the `--dry-run` branch (the
  tools' one door, lazily), validation for the launch's world, the model folder and engine checks,
  the task with its reward functions, the checkpoint to resume (its files and shapes), and the claim
  of the run directory (by train rank 0), all before any model, engine or process group is built.
- `resolve_path`: `--model.path` (a folder, a hub name, or `tiny`) as a local folder, checked whole: its config,
  tokenizer and safetensors files, and every weight its model has, in its shape (read on the meta device).
- `claim`: one live run owns a run directory and its checkpoint folder (kernel locks that die with
  their process); the run's identity (`run.json`, `begin`) is stamped on every checkpoint, so a folder
  holding another run's checkpoints is refused and a resume by path starts a new line.
- `run(name, main, argv)`: every command goes through it: exit 0; 2 with one line for a bad flag,
  file or checkpoint, or a reward past its timeout; 1 for a failed reward function; 3 for a run that
  can no longer learn; 4 for a lost peer; 130 for a Ctrl-C and 143 for a SIGTERM that stop at once (before
  the steps, or a second one). Under torchrun a failure's line is also what torchrun's summary shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import inspect
import json
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass

import torch

from minirl import checkpoint, dist, models, rewards, tasks
from minirl.accumulator import StalledError
from minirl.config import TINY, ConfigError, ModelConfig, first_line, holds_run, hub_name
from minirl.flags import parse
from minirl.rollout import check_model, check_reloads, meta_model


@dataclass
class Ready:
    """What a loop starts from, every check done (`preflight`)."""

    args: object         # GRPOArgs or PPOArgs, validated for this launch's world
    path: str            # the model's folder
    tok: object          # its tokenizer
    task: object         # the prompts, checked against the prompt budget, with their scorer
    resume: str | None   # the checkpoint to resume from, checked from its files, or None
    owner: dict = dataclasses.field(default_factory=dict)  # the run's identity (train rank 0; `claim`)

    @property
    def pad_id(self) -> int:
        return self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id


def preflight(cls, argv: list[str] | None, loop) -> Ready | None:
    """Parse and check everything a run of `loop` needs, cheapest first; None after a dry run."""
    args = parse(cls, argv, inspect.cleandoc(cls.__doc__))
    if args.dry_run:  # the tools' one door: the plan (and the rehearsal), or the rehearsal's child run
        if os.environ.get("MINIRL_REHEARSAL_CHILD") == "1":
            from minirl.tools import rehearse
            rehearse.child(args, loop)
            return None
        from minirl.tools import plan
        plan.dry_run(args)
        if args.rehearse and int(os.environ.get("RANK", 0)) == 0:  # one process rehearses train rank 0
            from minirl.tools import rehearse
            rehearse.run(sys.argv[1:] if argv is None else argv, cls.LOOP)
        return None
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    args.validate(world_size)
    path = resolve_path(args.model)
    ready = Ready(args, path, None, None, None)
    check_model(path, args.rollout, args.rollout.max_model_len,
                head_dim_flag="--model.tiny.num-heads" if args.model.path == TINY else "--model.path")
    check_reloads(path)
    ready.tok = models.load_tokenizer(path)
    ready.task = tasks.make_task(args.task, args.seed, ready.tok, args.rollout.max_prompt_tokens,
                                 bool(args.log.eval_every), args.steps)  # every prompt and reward function
    disaggregated = args.grid.gpu_placement == "disaggregated"
    train_ranks = world_size - (args.grid.rollout_ranks if disaggregated else 0)
    owner = identity(args.log.run_dir)
    owned_checkpoints(args, owner)
    ready.resume = checkpoint.find(args.checkpoint.resume, args.checkpoint_dir, cls.LOOP, train_ranks, args.steps,
                                   owner=owner)
    if ready.resume:  # another model's checkpoint is refused before the run directory is touched
        checkpoint.check_shapes(ready.resume, on_meta(path, checkpoint.PARTS[cls.LOOP]))
    if int(os.environ.get("RANK", 0)) == world_size - train_ranks:  # train rank 0: the one that writes the logs
        ready.owner = claim(args, ready.resume)
    return ready


def on_meta(path: str, kinds: tuple[str, ...]) -> dict:
    """The models of `kinds` (a loop's checkpoint parts) built on the meta device from config.json: names
    and shapes, no weights, for a resume's shape check."""
    from transformers import AutoConfig, AutoModel
    config = AutoConfig.from_pretrained(path)
    build = {"policy": lambda: meta_model(path),  # as the engine's weight sync builds it
             "value": lambda: models.ValueModel(AutoModel.from_config(config), config.hidden_size)}
    with torch.device("meta"):
        return {kind: build[kind]() for kind in kinds}


# ---- the model folder ----

def resolve_path(cfg: ModelConfig) -> str:
    """A local folder holding config.json and a tokenizer, checked whole (`check_folder`) before anything
    is loaded, or a ConfigError naming --model.path."""
    if cfg.path == TINY:
        return models.build_tiny(cfg.tiny)  # the built-in task's model
    if os.path.isdir(cfg.path):
        check_folder(cfg.path)
        return cfg.path
    if not hub_name(cfg.path):
        raise ConfigError(f"--model.path={cfg.path!r} does not exist; give a local model folder, a hub name "
                          f"like Qwen/Qwen2.5-0.5B-Instruct, or `{TINY}` for the built-in model")
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(cfg.path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated...
        raise ConfigError(f"--model.path={cfg.path!r}: there is no local folder of that name, and as a hub name it "
                          f"could not be fetched ({type(e).__name__}: {first_line(e)[:160]}); give an "
                          "existing local folder or download the model elsewhere") from e
    check_folder(folder)
    return folder


def check_folder(path: str) -> None:
    """A Hugging Face folder minirl can load: a config.json naming its model type, a tokenizer, whole safetensors
    files, and every weight its model has, in its shape (`_check_weights`)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise ConfigError(f"--model.path={path!r} has no config.json: not a Hugging Face model folder")
    try:
        with open(config) as f:
            hf = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--model.path: {config} is not valid JSON ({e})") from e
    if not isinstance(hf, dict) or "model_type" not in hf:
        raise ConfigError(f"--model.path: {config} names no model_type: not a Hugging Face model config")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LMS
    if hf["model_type"] not in CAUSAL_LMS:  # a model of remote code, or newer than this transformers
        raise ConfigError(f"--model.path: {config} names model_type {hf['model_type']!r}, which this transformers "
                          "cannot load as a causal language model (minirl runs no code of a model's own)")
    heads = hf.get("architectures") or []
    if heads and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in heads):
        raise ConfigError(f"--model.path: {config} is a {heads[0]}, a model that does not generate; the policy is a "
                          "causal language model (a reward model scores inside a --task.reward function)")
    names = os.listdir(path)
    if not any(n in names for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")):
        raise ConfigError(f"--model.path={path!r} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json); "
                          "copy the base model's tokenizer files beside its weights")
    if not any(n.endswith((".safetensors", ".bin")) for n in names):  # a hub model's: fetched as safetensors only
        raise ConfigError(f"--model.path={path!r} has no weights (no *.safetensors file); copy the model's weights "
                          "beside its config.json")
    for name in sorted(names):
        if name.endswith(".safetensors"):
            _check_safetensors(os.path.join(path, name))
        if name.endswith(".index.json"):  # a sharded model's: every shard it names is here (a download cut short)
            try:
                with open(os.path.join(path, name)) as f:
                    shards = set(json.load(f)["weight_map"].values())
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
                raise ConfigError(f"--model.path: {path}/{name} is not a readable shard index ({e!r})") from e
            missing = sorted(shards - set(names))
            if missing:
                raise ConfigError(f"--model.path: {path}/{name} names {len(missing)} shard(s) the folder lacks "
                                  f"({missing[0]}, ...); download them again")
    if "quantization_config" not in hf:  # a quantized model's weights are its quantizer's to name (vLLM reads them)
        _check_weights(path)


def _check_weights(path: str) -> None:
    """Every weight the model has is in the folder, in the shape config.json gives it: transformers reads the
    files' names and shapes onto the meta device (no data). It would start a missing weight at random and only
    warn, and vLLM serves the missing half of a weight it fuses (gate with up) as whatever memory held."""
    import transformers
    with models.quiet_load():  # its load report: what matters is said below, in a line
        _, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, device_map="meta", ignore_mismatched_sizes=True, output_loading_info=True)
    missing, wrong = sorted(info["missing_keys"]), sorted(info["mismatched_keys"])
    if missing:
        raise ConfigError(f"--model.path: {path} lacks {len(missing)} weight(s) of its model "
                          f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), which would start at "
                          "random: the checkpoint is cut short or is not the architecture its config.json names")
    if wrong:
        name, got, want = wrong[0]
        raise ConfigError(f"--model.path: {path} holds {len(wrong)} weight(s) of another shape than its config.json "
                          f"gives ({name}: {tuple(got)}, where the model has {tuple(want)}): the checkpoint is not "
                          "the architecture its config.json names")


def _check_safetensors(file: str) -> None:
    """The file's size covers its header and every tensor the header lists (no data is read)."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError("header cut short")
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--model.path: {file} is not a readable safetensors file ({e})") from e
    if 8 + n + end > size:
        raise ConfigError(f"--model.path: {file} is truncated ({size} bytes of {8 + n + end}); download it again")


def run(name: str, main, argv: list[str] | None = None) -> None:
    """Run `main(argv)` as a command: exit codes and one-line errors (the module docstring)."""
    code, said = 0, ""
    try:
        main(argv)
    # a bad flag, file or checkpoint (exit 2), or a failed reward function (its error's code): one line, no traceback
    except (ConfigError, checkpoint.CheckpointError, rewards.RewardError) as e:
        said, code = f"{name}: error: {e}", getattr(e, "code", 2)
    except KeyboardInterrupt:  # a Ctrl-C before the steps (the build, a resume's load), a second one, or a tool's
        said, code = f"{name}: interrupted (Ctrl-C)", 130
    except SystemExit as e:  # a SIGTERM before the steps, or a second one (dist.sigterm_flag): one line
        if e.code != 128 + signal.SIGTERM:
            raise
        said, code = f"{name}: stopped by SIGTERM", e.code
    except StalledError as e:  # the run can no longer learn: say why, no traceback
        said, code = f"{name}: stopped: {e}", 3
    except BrokenPipeError:  # a pipe's reader left (`--help | head`, a `tee` that died): no peer is lost
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's recipe (the signal module's docs)
        code = 1
        if not {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):  # a run: say why it stopped
            said = f"{name}: stopped: its output goes to a pipe whose reader has closed it (Broken pipe)"
    except Exception as e:  # a peer rank, its node or the run's store is gone: say which, no traceback
        lost = dist.lost_peer(e)
        if lost is None:  # any other error keeps its traceback; torchrun's summary shows the error's first line
            error_file(f"{type(e).__name__}: {first_line(e)}")
            raise
        said, code = f"{name}: error: {lost}", 4
    finally:
        if said:
            with contextlib.suppress(OSError):  # standard error may be that closed pipe too
                print(said, file=sys.stderr)
            if code not in (130, 128 + signal.SIGTERM):  # a stop (torchrun's own, of the others) is no cause
                error_file(said, later=code == 4)
        dist.shutdown()
    leave(code)


def error_file(line: str, later: bool = False) -> None:
    """Under torchrun, a failure's line goes to the worker's error file (TORCHELASTIC_ERROR_FILE) too: torchrun's
    failure summary, the last thing a multi-process launch prints, shows it as the worker's `traceback` (it said
    only "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"). Its root cause is the
    failure of the earliest whole second, a tie going to the lowest rank: a lost peer, the consequence of another
    rank's failure, is stamped `later` by a second, so the rank that failed first is named (not rank 0's notice)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time()) + later}, f)
        except OSError:
            pass


def leave(code: int) -> None:
    """Exit without the interpreter's teardown once everything is closed: C++ threads of the libraries
    underneath can abort there ("terminate called without an active exception", about one multi-rank
    run in ten), which would fail a finished run."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- the run directory: one live run owns it ----

_held: dict[str, object] = {}  # run dir -> its open lock file, kept open (and locked) until the process exits

OLD_RUN = ("run.json", "metrics.jsonl", "metrics.jsonl.tmp", "samples.jsonl", "samples.jsonl.tmp", "config.json", "final",
           "final.tmp", "tensorboard", "wandb", "wandb_run_id", "curve.png")


def identity(run_dir: str) -> dict:
    """The run a run directory holds, from its `run.json`: `run` (its id), `line` (the id of the line of
    checkpoints it is on) and `from` (the step that line started from); {} when it holds none."""
    try:
        with open(os.path.join(run_dir, "run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def owned_checkpoints(args, owner: dict) -> None:
    """A checkpoint folder belongs to one run (`owner`, the run directory's identity): one that holds
    another run's is refused (unless --log.overwrite, which removes them)."""
    other = "" if args.log.overwrite else checkpoint.foreign(args.checkpoint_dir, owner)
    if other:
        raise ConfigError(f"--checkpoint.dir={args.checkpoint_dir!r} holds another run's checkpoint ({other}); a "
                          "checkpoint folder belongs to one run: pick another --checkpoint.dir (or --log.overwrite "
                          "to remove them)")


def claim(args, resume: str | None) -> dict:
    """Own `args.log.run_dir` and `args.checkpoint_dir` for this run (train rank 0 only, the rank that writes
    both: the locks die with it); returns the run's identity (`identity`), begun or continued (`begin`). Under
    disaggregated placement the other ranks wait for it (refit.share_claim) before they touch either folder."""
    d = args.log.run_dir
    lock(d, "--log.run-dir")
    lock(args.checkpoint_dir, "--checkpoint.dir")
    if args.log.overwrite:
        clear(d, args.checkpoint_dir)
    elif args.checkpoint.resume == "auto" and resume is None and holds_run(d):
        if checkpoint.completed(args.checkpoint_dir):  # each was skipped, with a line saying why
            raise ConfigError(f"--checkpoint.resume auto: no checkpoint in {args.checkpoint_dir!r} can resume this "
                              "launch (the lines above say why); launch as they say, or start over with "
                              "--log.overwrite (which deletes them)")
        raise ConfigError(f"--checkpoint.resume auto: {d!r} holds a run but {args.checkpoint_dir!r} has no complete "
                          "checkpoint to resume; start over with --log.overwrite, or pick another --log.run-dir")
    return begin(args, resume)


def begin(args, resume: str | None) -> dict:
    """The run's identity in run.json: new when fresh, kept on `auto`, a new line on a resume by path,
    whose newer checkpoints are moved to `<checkpoint dir>/set_aside/<time>/` (never deleted)."""
    new, owner = uuid.uuid4().hex[:12], identity(args.log.run_dir)
    start = checkpoint.steps_done(resume) if resume else 0
    if not resume or not owner:
        owner = {"run": new, "line": new, "from": start}
    elif args.checkpoint.resume != "auto":
        owner = {"run": owner["run"], "line": new, "from": start}
    path = os.path.join(args.log.run_dir, "run.json")
    with open(path + ".tmp", "w") as f:
        json.dump(owner, f)
    os.replace(path + ".tmp", path)  # the new line first: a crash among the moves below leaves no doubt
    d = args.checkpoint_dir
    if not resume or args.checkpoint.resume == "auto":
        return owner
    newer = sorted(n for n in os.listdir(d) if n.startswith("step_") and n[5:13].isdigit() and int(n[5:13]) > start)
    if newer:
        aside = os.path.join(d, "set_aside", time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(aside, exist_ok=True)
        for n in newer:
            os.rename(os.path.join(d, n), os.path.join(aside, n))
        print(f"--checkpoint.resume={resume}: the line it leaves has newer checkpoints ({', '.join(newer)}); "
              f"they are set aside in {aside}", flush=True)
    return owner


def lock(folder: str, flag: str = "--log.run-dir") -> None:
    """Make `folder` (`flag`'s) and hold its lock for this process's life, or a ConfigError naming the flag."""
    path = os.path.abspath(os.path.join(folder, ".lock"))
    if path in _held:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        f = open(path, "a+")
    except OSError as e:  # under a file, on a read-only or full disk, not ours to write
        raise ConfigError(f"{flag}={folder!r} cannot be written ({e.strerror or e}); give a folder you can write") \
            from e
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"{flag}={folder!r} is in use by a live run ({holder}); wait for it to end, "
                          f"or pick another {flag}") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    f.flush()
    _held[path] = f


def clear(run_dir: str, checkpoint_dir: str) -> None:
    """--log.overwrite: remove what an old run left (never anything else in the folder). Its run.json goes
    first: a launch killed part way leaves the old checkpoints another run's, which no resume takes."""
    for name in sorted(os.listdir(run_dir), key=lambda name: name != "run.json"):
        if name in OLD_RUN or name.startswith("engine") and name.endswith(".log"):
            _remove(os.path.join(run_dir, name))
    for name in os.listdir(checkpoint_dir):  # the claim made it, and holds its lock
        if name.startswith("step_") or name == "set_aside":
            _remove(os.path.join(checkpoint_dir, name))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
