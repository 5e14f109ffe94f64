"""The GPU check script runs on CPU at a tiny size, so the one prepared for a lent H200 is not broken."""

import json
import sys

from conftest import run


def test_gpu_check_runs_at_tiny_size_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    p = run([sys.executable, "bench/gpu_check.py", "--size", "tiny", "--rows", "4", "--prompt", "8",
             "--completion", "32", "--n-micro", "1", "4", "--repeats", "1", "--out", str(out)], timeout=300)
    assert p.returncode == 0
    r = json.loads(out.read_text())
    assert [row["n_micro"] for row in r["micro_batching"]] == [1, 4]
    assert r["micro_batching"][1]["grad_diff"] <= 1e-5 * r["micro_batching"][1]["grad_max"]
    assert r["offload"]["bit_exact"] and r["determinism"]["equal_gradients"]
    assert r["throughput"]["step_s"] > r["throughput"]["floor_s"] > 0
    assert r["fp32_master"]["params"] == r["fp32_master"]["optimizer"] == ["torch.float32"]
    chunked = r["logprobs"]["chunked"]
    assert chunked["max_logprob_diff"] < 1e-5 and chunked["max_grad_diff"] <= 1e-5 * chunked["grad_max"]
