"""The fast tests as other machines run them: more or fewer cores, or a narrower vector unit.

A float32 tolerance a rounding step or two wide passes on the machine that set it and can fail on another,
whose thread count (`dist.place` gives each rank cpu_count / local ranks threads) or vector width splits
a sum otherwise: `make test` in a fresh clone failed so twice. This runs the fast tests once per machine
shape, each in a process that sees that many cores (os.cpu_count, the affinity mask, the OpenMP and MKL
pools) or that vector unit (ATen, oneDNN and MKL held to AVX2, or ATen's scalar kernels), and prints a
line per shape: its pass / fail count and each failed test; exit 1 if any test failed.

    .venv/bin/python bench/machines.py                                # 1, 4, 16, 64 cores; avx2; scalar
    .venv/bin/python bench/machines.py --cores 16 --isa -- tests/test_stream.py   # some shapes, some tests

About 4 minutes a shape on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = "not slow and not dist and not vllm and not serial"
SITE = """import os
_n = int(os.environ.get("MINIRL_BENCH_CORES", "0"))
if _n:  # this process and its children see a machine of _n cores
    os.cpu_count = lambda: _n
    os.sched_getaffinity = lambda pid: set(range(_n))
"""


def shapes(cores: list[int], isa: list[str]) -> list[tuple[str, dict]]:
    out = [(f"{n} cores", {"MINIRL_BENCH_CORES": str(n), "OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n)})
           for n in cores]
    for name in isa:  # ATen's kernels by name; oneDNN's and MKL's capped at AVX2 for both
        out.append((f"ATen {name}", {"ATEN_CPU_CAPABILITY": name, "ONEDNN_MAX_CPU_ISA": "AVX2",
                                     "MKL_ENABLE_INSTRUCTIONS": "AVX2"}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cores", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--isa", nargs="*", default=["avx2", "default"],
                    help="ATen CPU capabilities to run as (`default`: its scalar kernels; the flag alone: none)")
    ap.add_argument("tests", nargs="*", help="pytest arguments after --; default: the whole fast suite")
    args = ap.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as site:
        with open(os.path.join(site, "sitecustomize.py"), "w") as f:
            f.write(SITE)
        for name, env in shapes(args.cores, args.isa):
            path = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
            env = {**os.environ, **env, "PYTHONPATH": path}
            seen = subprocess.run([sys.executable, "-c", "import os; print(os.cpu_count())"], capture_output=True,
                                  text=True, env=env).stdout.strip()
            if env.get("MINIRL_BENCH_CORES", seen) != seen:  # another sitecustomize came first on the path
                raise SystemExit(f"bench/machines.py: a process asked to see {name} saw {seen} cores")
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "-m", FAST,
                                *args.tests], cwd=ROOT, capture_output=True, text=True, env=env)
            summary = (re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", p.stdout, re.M) or ["no summary"])[-1]
            print(f"{name:>12}: {summary}", flush=True)
            for failed in re.findall(r"^FAILED (\S+)", p.stdout, re.M):
                print(f"{'':>14}{failed}", flush=True)
            ok = ok and p.returncode == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
