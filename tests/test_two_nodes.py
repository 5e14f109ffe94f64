"""Two nodes for real: `torchrun --nnodes 2 --node-rank {0,1} --master-addr <node 0>` on two network
hosts (two network namespaces joined by a veth pair, tests/twohosts.py), each node its own network
stack, so a store or a world that assumes one host fails here as it fails on a cluster.

- disaggregated PPO, 2 nodes x 2 processes, 3 rollout ranks: train rank 0 (global rank 3) and rollout
  rank 2 live on node 1, away from the run's store on node 0; 2 steps, then a resume on the same nodes;
- colocated GRPO, 2 nodes x 2 processes, equals one node of 4 ranks;
- a node that loses the other leaves within seconds, naming the peer it lost and its address.
"""

import json
import math
import re
import time

import pytest
from safetensors.torch import load_file

from conftest import GRPO_SMALL
from twohosts import ADDRS, TwoHosts, kill_tree

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.dist]

WHY_NOT = TwoHosts.unavailable()
needs_hosts = pytest.mark.skipif(WHY_NOT is not None, reason=f"two network hosts unavailable: {WHY_NOT}")

PPO = ["-m", "minirl.ppo", "--grid.rollout-ranks", "3", "--ppo.num-prompts-per-step", "8",
       "--ppo.num-generations-per-prompt", "4", "--async-rl.min-groups-for-streaming-train", "2",
       "--log.eval-every", "0"]


def step_records(run_dir):
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "reward_mean" in line]


@pytest.fixture
def hosts():
    if WHY_NOT is not None:
        pytest.skip(f"two network hosts unavailable: {WHY_NOT}")
    with TwoHosts() as h:
        yield h


@needs_hosts
def test_disaggregated_ppo_on_two_nodes_trains_and_resumes(hosts, tmp_path):
    """3 rollout ranks on 2 x 2 processes: node 0 holds rollout ranks 0 and 1 (global rank 0 hosts the
    run's store), node 1 holds rollout rank 2 and the only train rank. Both nodes exit 0 after 2
    steps, every rollout rank (node 1's too) loads each version, and a resume on the same two nodes
    continues from the step-2 checkpoint."""
    run_dir = tmp_path / "run"
    flags = [*PPO, "--checkpoint.every", "1", "--log.run-dir", str(run_dir)]
    nodes = hosts.torchrun([*flags, "--steps", "2"], tmp_path, nproc=2)
    assert [n.returncode for n in nodes] == [0, 0]
    assert "step    1/2" in nodes[1].stdout  # train rank 0 lives on node 1
    for rank, node in ((0, 0), (1, 0), (2, 1)):
        assert re.findall(rf"rollout rank {rank}: loaded policy version (\d+)", nodes[node].stdout) == ["1", "2"]
    assert [r["step"] for r in step_records(run_dir)] == [0, 1]
    nodes = hosts.torchrun([*flags, "--steps", "3", "--checkpoint.resume", "auto"], tmp_path, nproc=2)
    assert [n.returncode for n in nodes] == [0, 0]
    assert "resumed from" in nodes[1].stdout and "step_00000002" in nodes[1].stdout
    assert re.findall(r"rollout rank 2: loaded policy version (\d+)", nodes[1].stdout) == ["2", "3"]
    assert [r["step"] for r in step_records(run_dir)] == [0, 1, 2]


def close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
    return a == b


@needs_hosts
def test_colocated_grpo_on_two_nodes_equals_one_node_of_four(hosts, grpo_four_ranks, tmp_path):
    """2 nodes x 2 colocated ranks (an engine and an FSDP2 shard each) log the metrics that one node
    of 4 ranks logs, to float tolerance, and reach its final weights."""
    run_dir = tmp_path / "run"
    nodes = hosts.torchrun(["-m", "minirl.grpo", *GRPO_SMALL, "--log.run-dir", str(run_dir)], tmp_path, nproc=2)
    assert [n.returncode for n in nodes] == [0, 0]
    skip = ("time", "tokens_per_s", "memory")
    one, two = (list(map(json.loads, open(d / "metrics.jsonl"))) for d in (grpo_four_ranks, run_dir))
    assert len(one) == len(two) and any("reward_mean" in r for r in two)
    for a, b in zip(one, two):
        a, b = ({k: v for k, v in r.items() if not k.startswith(skip)} for r in (a, b))
        assert a.keys() == b.keys() and all(close(a[k], b[k]) for k in a), (a, b)
    wa, wb = (load_file(d / "final" / "model.safetensors") for d in (grpo_four_ranks, run_dir))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5


@needs_hosts
@pytest.mark.serial  # a bound on the wall clock: it runs with no other test beside it
@pytest.mark.parametrize("lost", [0, 1])
def test_a_node_that_loses_the_other_leaves_naming_the_peer(hosts, tmp_path, lost):
    """Node `lost` is killed (every process, at once) once step 1 is under way; the surviving node's
    ranks leave by themselves within seconds, each with a line naming what it lost and its address,
    not after a store's or a collective's 30-minute timeout."""
    killed = {}

    def kill_when_training(procs):
        if "step    2/" not in (tmp_path / "node1.out").read_text(errors="replace"):
            return False
        kill_tree(procs[lost].pid)
        killed["at"] = time.time()
        return True

    nodes = hosts.torchrun([*PPO, "--steps", "500", "--log.run-dir", str(tmp_path / "run")], tmp_path, nproc=2,
                           timeout=420, grace=120, during=kill_when_training)
    took = time.time() - killed["at"]
    survivor = nodes[1 - lost]
    assert survivor.returncode not in (0, None, -9), survivor.returncode  # it left by itself, failing
    assert took < 60, f"{took:.0f} s from the kill to the surviving node's exit"
    said = survivor.stderr + survivor.stdout
    assert "lost" in said and ADDRS[lost] in said, said[-3000:]
    frames = [line for line in survivor.stderr.splitlines() if line.strip().startswith("File ")]
    assert not [f for f in frames if "/minirl/" in f], survivor.stderr[-3000:]  # torchrun's own summary aside
