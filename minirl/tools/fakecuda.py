"""The rehearsal's CUDA stand-ins: what a CPU-only torch needs to run on fake CUDA tensors.

`fakecuda.cpp` registers torch's FakeGuardImpl and a hooks object that reports devices (a CPU build has
neither, so a forward on fake CUDA aborts in C++); it is compiled once into minirl's cache folder and
preloaded into the rehearsal's child process (`rehearse.run`). In the child, `stand_ins()` answers what
torch.cuda asks of a driver and counts every host read of a CUDA value (`HOST_READS`), and
`flash_attention()` runs SDPA through the flash kernel's memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess

import torch

from minirl.config import ConfigError

SOURCE = os.path.join(os.path.dirname(__file__), "fakecuda.cpp")
HOST_READS = [0]  # values of CUDA tensors read on the host (`stand_ins` counts them)


def library() -> str:
    """fakecuda.cpp compiled for this torch, once, into minirl's cache folder; its path."""
    from minirl.models import cache_dir
    torch_dir = os.path.dirname(torch.__file__)
    with open(SOURCE, "rb") as f:
        key = hashlib.sha1(f.read() + torch.__version__.encode() + torch_dir.encode()).hexdigest()[:10]
    out = os.path.join(cache_dir(), f"fakecuda-{key}.so")
    if os.path.isfile(out):
        return out
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        raise ConfigError("--rehearse needs a C++ compiler to build its CUDA stand-ins against torch's headers "
                          "(once); none is on PATH: install g++ or set CXX")
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{out}.{os.getpid()}.tmp"
    lib = os.path.join(torch_dir, "lib")
    cmd = [cxx, "-O1", "-shared", "-fPIC", "-std=c++20", "-w", f"-I{os.path.join(torch_dir, 'include')}",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", SOURCE, "-o", tmp,
           f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]
    print(f"rehearsal: compiling the CUDA stand-ins for torch {torch.__version__} (once) into {out}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise ConfigError(f"--rehearse: {os.path.basename(cxx)} could not build {SOURCE}: "
                          + " | ".join(done.stderr.strip().splitlines()[-3:]))
    os.replace(tmp, out)
    return out


def stand_ins() -> None:
    """Python stand-ins for what torch.cuda asks of a driver (the C++ ones are preloaded), and answers
    for what a fake tensor cannot know: a value read on the host (`.item()`, `bool()`, `.tolist()`) is
    1 / True unless fake mode knows the constant (a finiteness flag reads finite, a token count
    nonzero), and pinning is a no-op. torch.cuda.is_available() stays False: fake mode then never
    initialises a device."""
    from torch._subclasses.fake_tensor import FakeTensor

    class Stream:
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            pass

        wait_stream = wait_event = synchronize = lambda self, *a: None  # noqa: E731
        record_event = lambda self, e=None: e or Event()  # noqa: E731

    class Event:
        def __init__(self, *a, **k):
            pass

        record = wait = synchronize = lambda self, *a: None  # noqa: E731
        query = lambda self: True  # noqa: E731

    torch.cuda.current_device = lambda: 0
    torch.cuda.Stream, torch.cuda.Event = Stream, Event
    torch.cuda.current_stream = lambda *a, **k: Stream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()

    def value(t):
        if t.constant is not None:
            return t.constant.item()
        return True if t.dtype == torch.bool else 1 if not t.is_floating_point() else 1.0

    def listed(t):
        return t.constant.tolist() if t.constant is not None else [listed(x) for x in t.unbind(0)] if t.dim() \
            else value(t)

    def read(answer):  # a value of a CUDA tensor read on the host: on a GPU, a sync that drains the queue
        def counted(t, *a):
            HOST_READS[0] += t.device.type == "cuda"
            return answer(t)
        return counted

    FakeTensor.item = read(value)
    FakeTensor.__bool__ = read(lambda t: bool(value(t)))
    FakeTensor.__float__ = read(lambda t: float(value(t)))
    FakeTensor.__int__ = read(lambda t: int(value(t)))
    FakeTensor.tolist = read(listed)
    torch.Tensor.pin_memory = lambda t, *a, **k: t  # real host tensors too: fake mode has no pinned memory


@contextlib.contextmanager
def flash_attention():
    """SDPA through the flash kernel: fake mode would take the math path, whose float32 scores a GPU
    never holds. (The padding-free path's block mask is then unused: the kernel's memory is the same.)"""
    plain = torch.nn.functional.scaled_dot_product_attention

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True, False, scale=scale)[0]

    torch.nn.functional.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = plain
