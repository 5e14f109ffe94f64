"""The memory gate (B16), on CPU: a GRPO step whose un-chunked update exceeds a memory budget fails,
and the same step micro-batched completes under it, with the same gradient. Peaks are measured by
bench/micro_memory.py, one process per configuration."""

import json
import sys

import pytest

from conftest import run

pytestmark = pytest.mark.slow


def rows(p):
    return {r["n_micro"]: r for r in map(json.loads, p.stdout.strip().splitlines())}


def test_unchunked_step_runs_out_of_memory_and_micro_batched_completes(tiny_path):
    free = rows(run([sys.executable, "bench/micro_memory.py", "--n-micro", "1", "8"]))
    p1, p8 = free[1]["peak_mib"], free[8]["peak_mib"]
    print(f"peak RSS growth of one step: un-chunked {p1} MiB, n_micro=8 {p8} MiB")
    assert p8 < p1 / 2
    grad_scale_tolerance = 1e-6  # float32, gradients of order 1 (see test_grpo_update)
    assert free[8]["grad_diff_vs_first"] < grad_scale_tolerance
    budget = int((p1 + p8) / 2)
    p = run([sys.executable, "bench/micro_memory.py", "--n-micro", "1", "8", "--budget-mib", str(budget)])
    capped = rows(p)
    assert p.returncode == 3
    assert capped[1].get("oom") and "allocate" in capped[1]["error"]
    assert not capped[8].get("oom") and capped[8]["peak_mib"] < budget
