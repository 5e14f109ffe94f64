"""`python -m minirl.tools.export CHECKPOINT OUT` (or `minirl-export`): a training checkpoint's policy as
a Hugging Face folder, the same as a run's `final/`.

The model it belongs to comes from the run's config.json beside the checkpoints folder
(`<run dir>/checkpoints/step_N` -> `<run dir>/config.json`); `--model.path` names its folder instead,
the run's dtype kept. The weights are read with the same checks as a resume (checkpoint.load_model:
nothing is unpickled blindly, the shapes must match), on one process, on CPU. OUT must be new or empty
(`--overwrite` replaces an earlier export there and nothing else): export never deletes what it did not
write (`check_out`).
"""

from __future__ import annotations

import argparse
import json
import os

from minirl.config import ConfigError, ModelConfig


def run_config_path(ckpt: str) -> str:
    """<run dir>/checkpoints/step_N -> <run dir>/config.json (which may not exist)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(ckpt))), "config.json")


def run_model_config(ckpt: str, model_path: str = "") -> ModelConfig:
    """The model a checkpoint was trained from, by its run's config.json; `model_path` (--model.path) names
    its folder instead, the run's dtype and tiny shape kept where its config.json is there."""
    from minirl.flags import fill
    run_config = run_config_path(ckpt)
    if not os.path.isfile(run_config):
        if model_path:
            return ModelConfig(path=model_path)
        raise ConfigError(f"{ckpt}: no {run_config} to say which model it belongs to; pass --model.path")
    with open(run_config) as f:
        cfg = fill(ModelConfig(), json.load(f).get("model", {}), "model.")
    cfg.path = model_path or cfg.path
    return cfg


def check_checkpoint(ckpt: str, flag: str) -> None:
    """`ckpt` is a training checkpoint folder, or one line says what it is instead (a run directory,
    its final/ export, a missing folder); a partial one is refused when it loads (checkpoint.load_model)."""
    if not os.path.isdir(ckpt):
        raise ConfigError(f"{flag}={ckpt!r} is not a folder; give a checkpoint, <run dir>/checkpoints/step_N")
    from minirl import checkpoint
    names = os.listdir(ckpt)
    held = any(n.startswith("step_") for n in names)  # the run's checkpoints/ folder itself
    if "metrics.jsonl" in names or "checkpoints" in names or held:
        newest = (checkpoint.completed(ckpt if held else os.path.join(ckpt, "checkpoints")) or [None])[-1]
        raise ConfigError(f"{flag}={ckpt!r} is {'a folder of checkpoints' if held else 'a run directory'}; give "
                          "one of its checkpoints ("
                          + (f"the newest is {newest}" if newest else "it has none")
                          + (f"), or use its exported policy: --model.path {os.path.join(ckpt, 'final')}"
                             if "final" in names else ")"))
    if "loop_state.json" not in names and ".metadata" not in names:
        raise ConfigError(f"{flag}={ckpt!r} is not a training checkpoint (no loop_state.json); give <run dir>/"
                          "checkpoints/step_N" + (", or a Hugging Face folder as --model.path" if "config.json" in names
                                                  else ""))


def check_out(out: str, ckpt: str, overwrite: bool) -> None:
    """Export never deletes what it did not write: OUT is new, empty or (with --overwrite) an earlier export,
    and never `/`, the working directory or above it, a folder holding the checkpoint or its run, or one
    inside the checkpoint folder (a prune would remove it)."""
    from minirl.run import CARD_MARK, TOKENIZER_FILES
    o, here, src = (os.path.realpath(x) for x in (out, os.getcwd(), ckpt))
    run_dir = os.path.dirname(os.path.dirname(src))
    if o in (os.sep, run_dir) or here == o or here.startswith(o + os.sep) or src == o or src.startswith(o + os.sep):
        raise ConfigError(f"OUT={out!r} is the current directory, a folder above it, or holds the checkpoint or its "
                          "run; give the export a folder of its own")
    if o.startswith(os.path.dirname(src) + os.sep):  # a keep-last-K prune or --log.overwrite would remove it
        raise ConfigError(f"OUT={out!r} is inside the checkpoint folder {os.path.dirname(src)}, where a prune or "
                          "--log.overwrite removes it; give the export a folder outside it")
    if not os.path.exists(o):
        return
    if not os.path.isdir(o):
        raise ConfigError(f"OUT={out!r} is a file; give a folder")
    names = os.listdir(o)
    if not names:
        return
    if not overwrite:
        raise ConfigError(f"OUT={out!r} is not empty; give a new folder, or --overwrite to replace an earlier export")
    strangers = [n for n in names if not (os.path.isfile(os.path.join(o, n)) and
                                          n.endswith((".safetensors", "README.md", *TOKENIZER_FILES)))]
    card = os.path.join(o, "README.md")
    signed = os.path.isfile(card) and CARD_MARK in open(card, encoding="utf-8", errors="replace").read(4096)
    if strangers or not signed or "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        what = f"it has {sorted(strangers)[:3]}" if strangers else "no minirl model card, config.json and weights"
        raise ConfigError(f"--overwrite: {out!r} does not hold an export ({what}); nothing was deleted")


def export(ckpt: str, out: str, model_path: str = "") -> str:
    from minirl import checkpoint, dist, launch, models
    from minirl.run import RUN_CONFIG, export_hf, model_card
    dist.init()
    cfg = run_model_config(ckpt, model_path)
    path = launch.resolve_path(cfg)
    policy = models.load_policy(path)
    checkpoint.load_model(ckpt, "policy", policy)
    where = os.path.join(*os.path.abspath(ckpt).split(os.sep)[-3:])  # <run>/checkpoints/step_N, not the whole path
    card = model_card(f"{os.path.basename(os.path.abspath(ckpt))} (exported)", cfg.path,
                      {"checkpoint": where, "steps": checkpoint.steps_done(ckpt), "dtype": cfg.dtype})
    files, run_config = {"README.md": card}, run_config_path(ckpt)
    if os.path.isfile(run_config):  # the run's task and rewards, for minirl-eval
        with open(run_config) as f:
            files[RUN_CONFIG] = f.read()
    export_hf(policy, path, out, is_main=True, dtype=models.DTYPES[cfg.dtype], files=files)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="minirl-export", description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("checkpoint", type=os.path.expanduser, help="a checkpoint folder: <run dir>/checkpoints/step_N")
    ap.add_argument("out", type=os.path.expanduser, help="the Hugging Face folder to write")
    ap.add_argument("--model.path", "--model-path", dest="model_path", default="", type=os.path.expanduser,
                    help="the model the checkpoint was trained from (default: the run's)")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT (nothing else is "
                    "ever deleted)")
    a = ap.parse_args(argv)
    check_checkpoint(a.checkpoint, "CHECKPOINT")  # before anything is loaded
    check_out(a.out, a.checkpoint, a.overwrite)
    print(f"exporting {a.checkpoint}: loading the model and its trained policy, then writing {a.out} ...", flush=True)
    print(f"exported {a.checkpoint} to {export(a.checkpoint, a.out, a.model_path)}")


def cli(argv: list[str] | None = None) -> None:
    from minirl import launch
    launch.run("minirl.export", main, argv)


if __name__ == "__main__":
    cli()
