"""Checkpoints: sharded model and optimizer state (torch.distributed.checkpoint), the loop state
beside it, and the final policy in Hugging Face format (safetensors).

Contract:
- `save` writes `<dir>/step_<N>.tmp/`, fsyncs it, writes the COMPLETE marker last and renames
  the folder to `step_<N>/` (N = loop steps done). A crash at any point leaves either the
  previous complete checkpoint or a `.tmp`/unmarked folder that is never loaded. The newest
  `keep` complete checkpoints are kept.
- `find(resume, dir)`: "" = fresh; "auto" = the newest complete checkpoint (fresh if none); else
  a folder, which must be complete. `load` raises CheckpointError naming the folder when it is
  partial or unreadable, before the run touches anything.
- Nothing is unpickled: DCP for tensors, JSON for the loop state, safetensors for RNG states.
All ranks call `save` and `load` (they are collectives).
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from minirl import dist

MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted or read; the message names its folder."""


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def find(resume: str, ckpt_dir: str) -> str | None:
    if not resume:
        return None
    if resume != "auto":
        if not os.path.isdir(resume) or not _complete(resume):
            raise CheckpointError(f"--checkpoint.resume={resume!r}: not a complete checkpoint "
                                  f"(no {MARKER} marker: the save was interrupted); use an earlier one or `auto`")
        return resume
    done = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") and not d.endswith(".tmp")
                  and _complete(os.path.join(ckpt_dir, d))) if os.path.isdir(ckpt_dir) else []
    return os.path.join(ckpt_dir, done[-1]) if done else None


def steps_done(path: str) -> int:
    """Loop steps a complete checkpoint holds (cheap: reads its JSON loop state)."""
    try:
        with open(os.path.join(path, "loop_state.json")) as f:
            return int(json.load(f)["steps_done"])
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable loop_state.json ({e})") from e


def save(ckpt_dir: str, steps_done: int, parts: dict, loop_state: dict, keep: int) -> str:
    """parts: {name: (model, optimizer)}, e.g. {"policy": ...} for GRPO, policy and value for PPO."""
    rank = torch.distributed.get_rank()
    final = os.path.join(ckpt_dir, f"step_{steps_done:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(_state(parts), checkpoint_id=tmp)
    save_file({"torch": torch.get_rng_state()}, os.path.join(tmp, f"rng_rank{rank}.safetensors"))
    if rank == 0:
        state = {**loop_state, "steps_done": steps_done, "world_size": torch.distributed.get_world_size(),
                 "python_rng": _jsonable(random.getstate()), "numpy_rng": _jsonable(np.random.get_state())}
        with open(os.path.join(tmp, "loop_state.json"), "w") as f:
            json.dump(state, f)
    dist.barrier()
    if rank == 0:
        _fault("kill_in_save", steps_done)  # tests: die after the data, before the marker
        _fsync_tree(tmp)
        with open(os.path.join(tmp, MARKER), "w") as f:
            f.write(f"{steps_done}\n")
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)  # re-saving a step after resuming from an older checkpoint
        os.rename(tmp, final)
        _fsync_dir(ckpt_dir)
        complete = sorted(d for d in os.listdir(ckpt_dir) if d.startswith("step_") and not d.endswith(".tmp"))
        for old in complete[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)
    dist.barrier()
    return final


def load(path: str, parts: dict) -> dict:
    """Restore each part's model and optimizer, and the RNG states, in place; return the loop state."""
    if not _complete(path):
        raise CheckpointError(f"checkpoint {path} has no {MARKER} marker: it is partial and will not be loaded")
    rank = torch.distributed.get_rank()
    try:
        with open(os.path.join(path, "loop_state.json")) as f:
            state = json.load(f)
        if state["world_size"] != torch.distributed.get_world_size():
            raise CheckpointError(f"checkpoint {path} was written by {state['world_size']} rank(s); "
                                  f"this run has {torch.distributed.get_world_size()}")
        sd = _state(parts)
        dcp.load(sd, checkpoint_id=path)
        for name, (model, optimizer) in parts.items():
            set_state_dict(model, optimizer, model_state_dict=sd[name], optim_state_dict=sd[name + ".optim"])
        torch.set_rng_state(load_file(os.path.join(path, f"rng_rank{rank}.safetensors"))["torch"])
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        first = (str(e).strip().splitlines() or [""])[0][:200]  # DCP's message embeds whole tracebacks
        raise CheckpointError(f"checkpoint {path} is unreadable ({type(e).__name__}: {first}); "
                              "resume from an earlier one") from e
    random.setstate(_tuple(state["python_rng"]))
    np.random.set_state(tuple(state["numpy_rng"][:1]) + (np.array(state["numpy_rng"][1], dtype=np.uint32),)
                        + tuple(state["numpy_rng"][2:]))
    return state


def _state(parts: dict) -> dict:
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


def _fault(name: str, step: int) -> None:
    if os.environ.get("MINIRL_FAULT") == f"{name}:{step}":
        os.kill(os.getpid(), 9)


def export_hf(model: torch.nn.Module, source_path: str, out_dir: str, is_main: bool) -> None:
    """Gather the full parameters (a collective: every rank calls) and, on rank 0, write
    `out_dir/` = the source folder's config and tokenizer files + `model.safetensors`."""
    state = {}
    for name, t in dist.full_parameters(model):
        if is_main:
            state[name] = t.to("cpu", copy=True).contiguous()
    if not is_main:
        return
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for f in os.listdir(source_path):
        if f.endswith((".json", ".txt", ".model", ".jinja")) and not f.endswith(".index.json"):
            shutil.copy(os.path.join(source_path, f), tmp)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    _fsync_tree(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)


def _fsync_tree(path: str) -> None:
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
