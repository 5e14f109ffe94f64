"""Checkpoints: sharded model and optimizer state (torch.distributed.checkpoint) and the loop state
beside it. All ranks call `save`, `commit` and `load` (collectives).

- `save` writes `<dir>/step_<N>.tmp/`; `commit` fsyncs it, writes the COMPLETE marker last, renames
  it to `step_<N>/` and prunes to the newest `keep`. A crash leaves the previous complete checkpoint
  or an unmarked folder, which is never loaded.
- `find` / `check`: "" is fresh, "auto" the newest complete checkpoint that passes (broken ones
  skipped with a line), else a folder that must pass; told from the files alone (loop state, loop,
  world size, every shard whole) before any model or engine is built.
- Nothing is unpickled blindly: DCP's `.metadata` goes through an unpickler that admits only DCP's
  own classes, and each non-tensor item must load with `weights_only=True` first; the loop state is
  JSON, the RNG states safetensors. Every parameter's shape is compared with the checkpoint's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import shutil

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

from minirl import dist
from minirl.config import first_line

MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or read; the message names its folder."""


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def find(resume: str, ckpt_dir: str, loop: str | None = None, world_size: int | None = None,
         steps: int | None = None, owner: dict | None = None) -> str | None:
    """The checkpoint to resume, checked (`check`) when `loop` is given: a named folder that fails is
    refused; `auto` takes the newest that passes, of this run's line (`owner`, launch.identity) or an
    earlier line up to where this one started. Refused when it holds more than `steps` steps; one that holds
    them all resumes only to finish the run (a stop after its last step left no export)."""
    path = _find(resume, ckpt_dir, loop, world_size, owner or {})
    if path and steps is not None and steps_done(path) > steps:
        raise CheckpointError(f"--steps={steps}: {path} already holds {steps_done(path)} steps, more than asked; "
                              f"give --steps {steps_done(path)} or more to continue the run")
    return path


def _find(resume: str, ckpt_dir: str, loop: str | None, world_size: int | None, owner: dict) -> str | None:
    if not resume:
        return None
    if resume != "auto":
        if not os.path.isdir(resume) or not _complete(resume):
            held = completed(os.path.join(resume, "checkpoints")) or completed(resume)  # a run dir, its checkpoints/
            if held:
                raise CheckpointError(f"--checkpoint.resume={resume!r} holds checkpoints and is not one: give one of "
                                      f"them (the newest complete one is {held[-1]}), or `auto`")
            raise CheckpointError(f"--checkpoint.resume={resume!r}: not a complete checkpoint "
                                  f"(no {MARKER} marker: the save was interrupted); use an earlier one or `auto`")
        if loop:
            check(resume, loop, world_size)
        return resume
    for path in reversed(completed(ckpt_dir)):
        try:
            state = _state(path)
            if owner and state.get("line", owner["line"]) != owner["line"] and steps_done(path) > owner["from"]:
                continue  # a line this run left when it resumed an older checkpoint by path
            if loop:
                check(path, loop, world_size)
            return path
        except CheckpointError as e:
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"--checkpoint.resume auto: skipping {e}", flush=True)
    return None


def completed(ckpt_dir: str) -> list[str]:
    """The complete checkpoints in `ckpt_dir`, oldest first."""
    done = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") and not d.endswith(".tmp")
                  and _complete(os.path.join(ckpt_dir, d))) if os.path.isdir(ckpt_dir) else []
    return [os.path.join(ckpt_dir, d) for d in done]


LOOP_KEYS = {"grpo": ("optimizer_steps", "skipped", "probe_done"), "ppo": ()}  # what each loop's resume reads


def check(path: str, loop: str, world_size: int) -> None:
    """What a complete checkpoint must be for this run, from its files alone: its loop state whole and
    of this loop and world size, every rank's shard and RNG state present, its metadata DCP's classes
    only (`_SafeUnpickler`), every data file as long as the metadata says."""
    state = _state(path)
    if state.get("loop", loop) != loop:
        raise CheckpointError(f"checkpoint {path} was written by minirl.{state['loop']}; this is minirl.{loop}")
    missing = [k for k in ("steps_done", "world_size", "python_rng", "numpy_rng", *LOOP_KEYS[loop]) if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path}: loop_state.json has no {', '.join(missing)}"
                              + (" (a minirl.ppo checkpoint?)" if loop == "grpo" and "loop" not in state else ""))
    if world_size is not None and state["world_size"] != world_size:
        raise CheckpointError(f"checkpoint {path} was written by {state['world_size']} train rank(s); this run has "
                              f"{world_size}: launch with {state['world_size']}, or start fresh")
    names = os.listdir(path)
    for r in range(state["world_size"]):
        shards = [n for n in names if n.startswith(f"__{r}_") and n.endswith(".distcp")]
        for n in shards + [f"rng_rank{r}.safetensors", ".metadata"]:
            if n not in names or os.path.getsize(os.path.join(path, n)) == 0:
                raise CheckpointError(f"checkpoint {path}: {n} is missing or empty (a lost or cut-short file); "
                                      "resume from an earlier one")
        if not shards:
            raise CheckpointError(f"checkpoint {path}: rank {r}'s shard (__{r}_*.distcp) is missing; "
                                  "resume from an earlier one")
    md = _read_metadata(path)  # a crafted one is refused here too, before anything is built
    ends: dict[str, int] = {}  # every data file must hold the bytes the metadata places in it
    for info in getattr(md, "storage_data", {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = os.path.getsize(os.path.join(path, name)) if name in names else -1
        if size < end:
            what = "missing" if size < 0 else f"cut short ({size} of {end} bytes)"
            raise CheckpointError(f"checkpoint {path}: {name} is {what}; resume from an earlier one")


def steps_done(path: str) -> int:
    """Loop steps a complete checkpoint holds (cheap: reads its JSON loop state)."""
    try:
        return int(_state(path)["steps_done"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable loop_state.json ({e!r})") from e


def _state(path: str) -> dict:
    try:
        with open(os.path.join(path, "loop_state.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable loop_state.json ({e})") from e


def foreign(ckpt_dir: str, owner: dict) -> str:
    """The first complete checkpoint in `ckpt_dir` written by a run other than `owner`'s (a run directory's
    identity; {} for a run directory that holds none yet), or "". A checkpoint folder belongs to one run."""
    names = sorted(os.listdir(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
    for d in (d for d in names if d.startswith("step_") and _complete(os.path.join(ckpt_dir, d))):
        with contextlib.suppress(CheckpointError):
            state = _state(os.path.join(ckpt_dir, d))
            if state.get("run", owner.get("run")) != owner.get("run"):
                return f"{os.path.join(ckpt_dir, d)}, written by the run in {state.get('run_dir')}"
    return ""


def require_finite(models: dict) -> None:
    """Refuse (on every rank together) to write a model with a non-finite parameter anywhere. One host
    read for all the parameters (each its own would be a sync per parameter on a GPU)."""
    named = [(f"the {part}'s {name}", p.to_local() if hasattr(p, "to_local") else p)
             for part, model in models.items() for name, p in model.named_parameters()]
    finite = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist() if named else []  # one read
    bad = next((where for (where, _), ok in zip(named, finite) if not ok), "")
    flag = dist.all_reduce(torch.tensor([float(bool(bad))]), "max")
    if flag.item():
        raise CheckpointError(f"refusing to write a model whose parameters are not finite ({bad or 'on another rank'})")


def save(ckpt_dir: str, steps_done: int, parts: dict, loop_state: dict, keep: int, complete: bool = True) -> str:
    """parts: {name: (model, optimizer)}. A non-finite model is never written (`require_finite`).
    `complete=False`: the data only, under `.tmp`; `commit` makes it count once the run's records of
    the step are written."""
    require_finite({name: model for name, (model, _) in parts.items()})
    rank = torch.distributed.get_rank()
    final = os.path.join(ckpt_dir, f"step_{steps_done:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    failure = None
    try:
        dcp.save(state_dicts(parts), checkpoint_id=tmp)
        if rank == 0 and dist.fault_due("kill_mid_file", steps_done):  # tests: a data file cut short, then death
            data = sorted(f for f in os.listdir(tmp) if f.endswith(".distcp"))[0]
            os.truncate(os.path.join(tmp, data), os.path.getsize(os.path.join(tmp, data)) // 2)
            dist.fault("kill_mid_file", steps_done)
        save_file({"torch": torch.get_rng_state()}, os.path.join(tmp, f"rng_rank{rank}.safetensors"))
        if rank == 0:
            state = {**loop_state, "steps_done": steps_done, "world_size": torch.distributed.get_world_size(),
                     "python_rng": _jsonable(random.getstate()), "numpy_rng": _jsonable(np.random.get_state())}
            with open(os.path.join(tmp, "loop_state.json"), "w") as f:
                json.dump(state, f)
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException
        failure = e
    if dist.all_reduce(torch.tensor([float(failure is not None)]), "max").item():  # every rank stops alike
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never resumed; frees what it took (a full disk)
        why = _cause(failure, ckpt_dir, parts) if failure else "on another rank"
        raise CheckpointError(f"saving the checkpoint {final} failed: {why}; the earlier checkpoints are untouched") \
            from failure
    dist.barrier()
    return commit(ckpt_dir, steps_done, keep) if complete else tmp


def commit(ckpt_dir: str, steps_done: int, keep: int) -> str:
    """Make the written `step_<N>.tmp/` count (every rank calls; rank 0 writes): its files fsynced, the
    COMPLETE marker, the rename to `step_<N>/`, then the prune to the newest `keep`."""
    final = os.path.join(ckpt_dir, f"step_{steps_done:08d}")
    tmp = final + ".tmp"
    if torch.distributed.get_rank() == 0:
        dist.fault("kill_in_save", steps_done)  # tests: die after the data, before the marker
        fsync_tree(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            f.write(f"{steps_done}\n")
            f.flush()
            os.fsync(f.fileno())
        dist.fault("kill_before_rename", steps_done)  # tests: complete, but still under its .tmp name
        shutil.rmtree(final, ignore_errors=True)  # re-saving a step after resuming from an older checkpoint
        os.rename(tmp, final)
        _fsync_dir(ckpt_dir)
        dist.fault("kill_before_prune", steps_done)  # tests: complete and in place, the old ones not yet pruned
        complete = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") and not d.endswith(".tmp"))
        for old in complete[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)
    dist.barrier()
    return final


def _cause(e: BaseException, ckpt_dir: str, parts: dict) -> str:
    """What went wrong under a failed save: DCP wraps each rank's error, and torch's writer reports a full
    disk as "unexpected pos", so too little room for this rank's shard is named as such."""
    seen = _errors(e)
    todo = list(seen)
    while todo:
        x = todo.pop(0)
        if isinstance(x, OSError):
            return f"[Errno {x.errno}] {x.strerror}" + (f": {x.filename}" if x.filename else "")
        todo += [c for c in (x.__cause__, x.__context__) if c is not None]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  (this rank's shard)
    need = sum(local(t).numel() * t.element_size() for m, o in parts.values() for t in [*m.parameters(), *_moments(o)])
    free = shutil.disk_usage(ckpt_dir).free
    if free < need:
        return (f"[Errno 28] No space left on device ({free / 2**20:.1f} MiB free under {ckpt_dir}, this rank's shard "
                f"needs about {need / 2**20:.1f} MiB); free some space or point --checkpoint.dir elsewhere")
    return _first_line(seen[0])


def _errors(e: BaseException) -> list[BaseException]:
    """Each rank's error that DCP's CheckpointException carries (with its traceback), then `e` itself."""
    return [x[0] if isinstance(x, tuple) else x for x in getattr(e, "failures", {}).values()] + [e]


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_line(e)[:200]}"  # DCP's embed whole tracebacks


def _moments(optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def load(path: str, parts: dict) -> dict:
    """Restore each part's model and optimizer, and the RNG states, in place; return the loop state. `path`
    is one `find` returned: complete, and written by this loop at this world size (`check`)."""
    rank = torch.distributed.get_rank()
    try:
        state = _state(path)
        sd = state_dicts(parts)
        _safe_load(path, sd, parts)
        for name, (model, optimizer) in parts.items():
            set_state_dict(model, optimizer, model_state_dict=sd[name], optim_state_dict=sd[name + ".optim"])
        torch.set_rng_state(load_file(os.path.join(path, f"rng_rank{rank}.safetensors"))["torch"])
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's is a BaseException; it carries each rank's error
        errors = _errors(e)
        ours = [x for x in errors if isinstance(x, CheckpointError)]
        why = _first_line(errors[0])
        if isinstance(errors[0], pickle.UnpicklingError):  # torch's message is advice on calling torch.load
            why = "a data file holds bytes that are not the tensors its metadata places there"
        raise CheckpointError(str(ours[0]) if ours else f"checkpoint {path} is unreadable ({why}); resume from an "
                              "earlier one") from e
    random.setstate(_tuple(state["python_rng"]))
    np.random.set_state(tuple(state["numpy_rng"][:1]) + (np.array(state["numpy_rng"][1], dtype=np.uint32),)
                        + tuple(state["numpy_rng"][2:]))
    return state


# ---- reading a checkpoint without running what it holds ----

_METADATA_CLASSES = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")}  # Python 3.13 pickles a path from pathlib._local


class _SafeUnpickler(pickle.Unpickler):
    """DCP's `.metadata`: its own dataclasses, sizes, dtypes and layouts, and nothing else."""

    def __init__(self, f, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path}: refers to {module}.{name}, which a checkpoint's metadata never does; "
                              "refusing to load it (a crafted checkpoint can run code when unpickled)")


def _read_metadata(folder: str):
    """A checkpoint's DCP `.metadata`, through `_SafeUnpickler` only."""
    path = os.path.join(folder, ".metadata")
    with open(path, "rb") as f:
        try:
            return _SafeUnpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: unreadable DCP metadata ({type(e).__name__}: {e})") from e


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        metadata = _read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """Non-tensor items (optimizer hyperparameters) must load with `weights_only=True` before DCP's
    own `torch.load(weights_only=False)` reads the same bytes."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(f"checkpoint item {read_item.dest_index.fqn}: not plain data ({e}); "
                                  "refusing to load it") from e
        value.seek(0)
        super().load_bytes(read_item, value)


def _safe_load(path: str, sd: dict, parts: dict) -> None:
    """DCP's load of `sd` from `path`, with the metadata and non-tensor items read safely and every
    parameter's shape checked against `parts` first."""
    reader = _SafeReader(path)
    _check_shapes(path, reader.read_metadata(), parts)
    dcp.load(sd, storage_reader=reader, planner=_SafePlanner())


PARTS = {"grpo": ("policy",), "ppo": ("policy", "value")}  # the models each loop's checkpoint holds


def check_shapes(path: str, models: dict) -> None:
    """`check`'s last part, given the run's models (on the meta device will do: only the shapes are read):
    every parameter in the checkpoint with the shape it has here."""
    _check_shapes(path, _read_metadata(path), {part: (model, None) for part, model in models.items()})


def _check_shapes(path: str, metadata, parts: dict) -> None:
    """Every parameter is in the checkpoint with the shape this model has, or say which is not."""
    saved = metadata.state_dict_metadata
    for part, (model, _) in parts.items():
        for name, p in model.named_parameters():
            key = f"{part}.{name}"
            if key not in saved:
                raise CheckpointError(f"checkpoint {path} has no parameter {name!r} for the {part}: it was written "
                                      "for another model; check --model.path")
            shape = tuple(getattr(saved[key], "size", ()))
            if shape != tuple(p.shape):
                raise CheckpointError(f"checkpoint {path}: the {part}'s {name!r} has shape {shape} there and "
                                      f"{tuple(p.shape)} in this model; it was written for another model shape "
                                      "(check --model.path and --model.tiny.*)")


def load_model(path: str, part: str, model: torch.nn.Module) -> None:
    """One part's weights only (no optimizer, no RNG), into a model of any sharding: what
    `minirl.export` and `minirl.eval` need from a training checkpoint."""
    if not _complete(path):
        raise CheckpointError(f"checkpoint {path} has no {MARKER} marker: it is partial and will not be loaded")
    sd = {part: get_model_state_dict(model)}
    _safe_load(path, sd, {part: (model, None)})
    set_model_state_dict(model, sd[part])


def report_lr(optimizer, next_lr: float, flag: str, say) -> None:
    """The flags' schedule sets a resumed run's rate, never the checkpoint's optimizer: say so when they differ."""
    saved = sorted({g["lr"] for g in optimizer.param_groups})
    if saved != [next_lr]:
        say(f"{flag}: the checkpoint's optimizer was at lr {', '.join(f'{x:g}' for x in saved)}; the schedule "
            f"of the flags sets the rate, {next_lr:g} at the next step")


def state_dicts(parts: dict) -> dict:
    """What DCP writes and reads: each model's and optimizer's sharded state dict (no full gather)."""
    out = {}
    for name, (model, optimizer) in parts.items():
        out[name], out[name + ".optim"] = get_state_dict(model, optimizer)
    return out


def _jsonable(x):
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    return x.item() if isinstance(x, np.generic) else x


def _tuple(x):
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x


def fsync_tree(path: str) -> None:
    """Every file under `path`, and the folders, on disk (before a rename or marker makes it count)."""
    for root, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
