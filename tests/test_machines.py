"""The equivalence tests hold on machines other than this one (B16, S8, X1): tolerances a rounding step or
two wide passed here and failed on machines of 16 cores, whose thread pools split a sum otherwise
(`dist.place` gives a rank cpu_count / local ranks threads). bench/machines.py runs them as such a machine."""

import sys

from conftest import run

# the test files that compare two computations in floating point: chunked and whole, packed and padded, ...
EQUIVALENCE = ["tests/test_stream.py", "tests/test_packing.py", "tests/test_grpo_update.py", "tests/test_models.py",
               "tests/test_accumulator.py", "tests/test_objective.py", "tests/test_gae.py", "tests/test_batch.py"]


def test_the_equivalence_tests_pass_as_machines_of_one_core_and_of_16_run_them():
    p = run([sys.executable, "bench/machines.py", "--cores", "1", "16", "--isa", "--", *EQUIVALENCE])
    shapes = [line.split(":")[0].strip() for line in p.stdout.splitlines() if not line.startswith(" " * 14)]
    assert shapes == ["1 cores", "16 cores"] and p.stdout.count(" passed") == 2, p.stdout
    assert p.returncode == 0 and "failed" not in p.stdout, p.stdout
