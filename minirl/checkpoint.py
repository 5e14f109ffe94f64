"""Saving models: the final policy in Hugging Face format (safetensors).

Written to a temporary folder and renamed into place, so a crash mid-write never leaves a
folder that looks complete.
"""

from __future__ import annotations

import os
import shutil

import torch
from safetensors.torch import save_file

from minirl import dist


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
    _fsync_dir(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)


def _fsync_dir(path: str) -> None:
    for f in os.listdir(path):
        with open(os.path.join(path, f), "rb") as fh:
            os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
