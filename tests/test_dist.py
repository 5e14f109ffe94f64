"""dist.py: two processes over gloo (torchrun --standalone) for FSDP2, the DP partition, the divisor
all-reduce and the disaggregated groups; and, with no processes, the device map over 8-GPU layouts,
the CUDA world's backend, the collectives' device check and the float32 master weights."""

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import torchrun
from minirl import dist, refit


@pytest.mark.dist
def test_two_rank_chunked_deferred_step_equals_single_process_whole_batch(tiny_path):
    """Also: dist.full_parameters (what the engine is sent) equals the trainer's parameters."""
    p = torchrun("tests/dist/fsdp_chunked_step.py", tiny_path)
    assert p.returncode == 0
    assert "OK grad_diff=" in p.stdout


@pytest.mark.dist
def test_disaggregated_rollout_rank_and_train_group_meet_through_the_store(tiny_path):
    p = torchrun("tests/dist/disaggregated_groups.py", tiny_path, nproc=3)
    assert p.returncode == 0
    assert "ROLLOUT OK" in p.stdout and p.stdout.count("TRAIN rank") == 2


def test_a_private_world_of_one_takes_its_port_as_its_store_binds_it():
    """A rollout rank's engine world (`dist.private_world`) gives its store port 0, so the kernel picks a free
    port in the bind itself: a port found free first and bound later can be taken in between (seen as
    EADDRINUSE on a two-node run). Two such worlds start at once on one host, each on a port of its own."""
    code = ("import os, torch, torch.distributed as d\n"
            "from minirl import dist\n"
            "with dist.private_world(torch.device('cpu')):\n"
            "    assert os.environ['MASTER_PORT'] == '0', os.environ['MASTER_PORT']\n"
            "    d.init_process_group('gloo', init_method='env://')\n"
            "    s = d.distributed_c10d._get_default_store()\n"
            "    while hasattr(s, 'underlying_store'):\n"
            "        s = s.underlying_store\n"
            "    print('PORT', d.get_world_size(), s.port)\n"
            "    d.destroy_process_group()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-500:] for _, err in outs]
    ports = [int(out.split()[-1]) for out, _ in outs]
    assert all(out.split()[1] == "1" for out, _ in outs) and 0 not in ports and ports[0] != ports[1]


def test_the_run_store_is_torchruns_own_and_binds_no_second_port(monkeypatch):
    """Under torchrun the run's store is the agent's, already listening at MASTER_PORT: global rank 0
    connects as a client (a bind there would fail), and nothing binds the port after it (CI once saw
    EADDRINUSE there, where another process's socket had that port). Under another launcher rank 0 hosts it."""
    agent = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, use_libuv=True)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    store = refit.run_store("127.0.0.1", agent.port, host=True)
    store.set("k", "v")
    assert agent.get("minirl/2/k") == b"v"  # the agent's store, under this launch attempt's prefix
    assert refit.store_client(store).get("k") == b"v"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    with pytest.raises(Exception, match="EADDRINUSE|address already in use"):
        refit.run_store("127.0.0.1", agent.port, host=True)  # another launcher: rank 0 binds MASTER_PORT itself


def test_every_rank_waits_for_train_rank_0s_claim_of_the_run_directory_and_takes_its_identity():
    """Disaggregated, global rank 0 is a rollout rank and train rank 0 claims the run directory: a rank that
    went on before the claim once had its engine log, or the trainer its metrics.jsonl, removed by another
    rank's --log.overwrite, and train rank 0 stamped its checkpoints with no run identity."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, use_libuv=True)
    client = torch.distributed.TCPStore("127.0.0.1", store.port, is_master=False, use_libuv=True,
                                        timeout=datetime.timedelta(seconds=20))  # the waiting rank's connection
    devices = dist.Devices(None, torch.device("cpu"))
    taken = []
    waiter = threading.Thread(target=lambda: taken.append(refit.share_claim(client, refit.Roles(0, 3, 1, devices), {})))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not taken  # rollout rank 0 waits for the claim
    owner = {"run": "r1", "line": "r1", "from": 0}
    assert refit.share_claim(store, refit.Roles(1, 3, 1, devices), owner) == owner  # train rank 0 posts its own
    waiter.join(10)
    assert taken == [owner]
    assert refit.share_claim(store, refit.Roles(2, 3, 1, devices), {}) == owner  # train rank 1


def test_a_rank_waiting_for_the_claim_leaves_at_once_on_ctrl_c():
    """A blocking get on the store holds a signal until it returns (30 minutes, the store's timeout)."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, use_libuv=True)
    code = ("import signal, torch, torch.distributed as d; from minirl import dist, refit; "
            "signal.signal(signal.SIGINT, signal.default_int_handler); "  # as in a terminal (a background job ignores it)
            f"s = d.TCPStore('127.0.0.1', {store.port}, is_master=False, use_libuv=True); print('waiting', flush=True); "
            "refit.share_claim(s, refit.Roles(0, 2, 1, dist.Devices(None, torch.device('cpu'))), {})")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "waiting\n"
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=10)
    finally:
        p.kill()
    assert "KeyboardInterrupt" in err


def test_a_disaggregated_rollout_rank_joins_the_store_only_and_a_train_rank_the_train_group(monkeypatch):
    """`init_disaggregated` in one process, a rank at a time, under torchrun's agent store. Of 3 ranks with
    1 rollout rank: rank 0 gets the run's store and no process group, and keeps its global RANK and
    WORLD_SIZE; rank 2 forms the train group (recorded here: a group of 2 cannot form in one process) as
    train rank 1 of 2, on the same store under the prefix `train/`, and RANK and WORLD_SIZE become the
    train group's."""
    agent = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, use_libuv=True)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(dist, "_here", dict(dist._here))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the cores' share is dist.place's, tested alone
    calls = []
    monkeypatch.setattr(refit.tdist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    env = dict(WORLD_SIZE="3", LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(agent.port))
    for k, v in {**env, "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    roles, world, store = refit.init_disaggregated(1)
    assert roles.generates and not roles.trains and world is None and calls == []
    assert dist._here == {"rank": 0, "store": f"127.0.0.1:{agent.port}"}
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "3")
    store.set("seen", "1")
    assert agent.check(["minirl/0/seen"])  # check, not get: a missing key would wait for the store's timeout

    for k, v in {**env, "RANK": "2", "LOCAL_RANK": "2"}.items():
        monkeypatch.setenv(k, v)
    roles, world, store = refit.init_disaggregated(1)
    assert roles.trains and world == dist.World(1, 2, 2, torch.device("cpu"))
    assert store.get("seen") == b"1" and dist._here["rank"] == 2
    (backend,), kw = calls[0]
    assert len(calls) == 1 and backend == "gloo"
    assert (kw["rank"], kw["world_size"], kw["device_id"]) == (1, 2, None)
    kw["store"].set("k", "v")
    assert agent.check(["minirl/0/train//k"])  # PrefixStore joins with "/", so the prefix "train/" gives two
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")


# ---- devices and backends (pure functions, no processes) ----

LAYOUTS = [(8, r) for r in range(1, 8)] + [(16, 2), (16, 8)]  # (world size, rollout ranks); 16 = 2 nodes x 8


def _map(world, rollout, placement):
    from minirl.dist import device_map
    out = []
    for g in range(world):
        node, local = divmod(g, 8)
        d = device_map(g, local, world, rollout, placement, "cuda")
        out.append((node, d))
    return out


@pytest.mark.parametrize("world,rollout", LAYOUTS)
def test_device_map_disaggregated_engines_on_their_own_cards_apart_from_trainers(world, rollout):
    ranks = _map(world, rollout, "disaggregated")
    engines = [(n, d.engine) for n, d in ranks if d.engine is not None]
    trainers = [(n, d.trainer) for n, d in ranks if d.trainer is not None]
    assert len(engines) == rollout and len(trainers) == world - rollout
    assert all(d.engine is None or d.trainer is None for _, d in ranks)   # one role per rank
    assert len(set(engines)) == len(engines)                              # no card holds two engines
    assert not set(engines) & set(trainers)                               # nor an engine and a trainer
    assert len(set(trainers)) == len(trainers)
    assert all(dev.type == "cuda" and dev.index == g % 8 for g, (_, dev) in enumerate(engines + trainers))
    roles = [refit.Roles(g, world, rollout, d) for g, (_, d) in enumerate(ranks)]  # the side each rank plays
    assert [(r.generates, r.trains) for r in roles] == [(d.engine is not None, d.trainer is not None) for _, d in ranks]
    assert [r.global_rank for r in roles if r.trains] == list(range(rollout, world))  # the train ranks come last


@pytest.mark.parametrize("world", [1, 2, 8, 16])
def test_device_map_colocated_engine_shares_the_trainers_card(world):
    ranks = _map(world, 0, "colocated")
    assert all(d.engine == d.trainer == torch.device("cuda", g % 8) for g, (_, d) in enumerate(ranks))
    assert len({(n, d.trainer) for n, d in ranks}) == world


def test_device_map_on_cpu_and_bad_layouts():
    from minirl.dist import device_map
    assert device_map(1, 1, 2, 1, "disaggregated", "cpu").trainer == torch.device("cpu")
    with pytest.raises(ValueError):
        device_map(0, 0, 2, 2, "disaggregated", "cuda")  # no train rank left


def test_cuda_world_backend_serves_cpu_tensors_too():
    """NCCL takes CUDA tensors only; minirl's metric all-reduces are CPU tensors."""
    from minirl.dist import backend_for
    served = {part.split(":")[0] for part in backend_for("cuda").split(",")}
    assert served == {"cpu", "cuda"} and "cuda:nccl" in backend_for("cuda")
    assert backend_for("cpu") == "gloo"


def test_collective_on_a_device_the_group_does_not_serve_is_refused(world, monkeypatch):
    from minirl import dist
    dist.init()  # a world of one again, should an earlier test's in-process engine have torn it down
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(RuntimeError, match="serves only"):
        dist.all_reduce(torch.zeros(1))
    with pytest.raises(RuntimeError, match="serves only"):
        dist.broadcast(torch.zeros(1), src=0)


def test_every_collective_goes_through_dist():
    """Outside dist.py nothing calls torch.distributed's collectives directly (they would skip the device check)."""
    import glob
    import re
    from conftest import ROOT
    direct = re.compile(r"torch\.distributed\.(all_reduce|broadcast|all_gather\w*|reduce_scatter\w*|gather|scatter|"
                        r"send|recv|barrier)\(")
    hits = [f"{os.path.basename(f)}:{n}" for f in glob.glob(os.path.join(ROOT, "minirl", "*.py"))
            if not f.endswith("dist.py") for n, line in enumerate(open(f), 1) if direct.search(line)]
    assert hits == []


def test_sharded_models_keep_float32_masters_and_compute_in_bf16(tiny_path, world):
    """--model.dtype bfloat16: local parameters, gradients and AdamW state float32; the forward in bf16."""
    from minirl import models
    for kind in ("policy", "value"):
        m = models.sharded(tiny_path, kind, world, "bfloat16")
        seen = []
        m.model.layers[0].mlp.gate_proj.register_forward_hook(lambda mod, i, o: seen.append(o.dtype))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        ids = torch.randint(3, 40, (2, 9))
        out = models.token_logprobs(m, ids) if kind == "policy" else m(ids)
        out.sum().backward()
        opt.step()
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        assert seen == [torch.bfloat16]
        assert {local(p).dtype for p in m.parameters()} == {torch.float32}
        assert {local(p.grad).dtype for p in m.parameters()} == {torch.float32}
        assert {local(v).dtype for s in opt.state.values() for v in s.values() if v.numel() > 1} == {torch.float32}


def test_full_parameters_in_a_world_of_one_are_private_copies_of_the_checkpoints_tensors(tiny_path, world):
    """A mesh of one skips the gather: every name and value the engine is sent equals the checkpoint's,
    in plain tensors that a receiver may write into without touching the trainer's masters."""
    from safetensors.torch import load_file

    from minirl import dist, models
    saved = load_file(f"{tiny_path}/model.safetensors")
    policy = models.sharded(tiny_path, "policy", world, "float32")
    sent = dict(dist.full_parameters(policy))
    assert sent.keys() == saved.keys()  # tied head: the engine gets it from the embedding
    assert all(torch.equal(sent[k], saved[k]) for k in saved)
    assert not any(hasattr(t, "to_local") for t in sent.values())  # plain tensors, not DTensors
    for t in sent.values():
        t.add_(1.0)
    assert all(torch.equal(p.to_local(), saved[k]) for k, p in policy.named_parameters())


def safetensors_dtypes(path) -> set[str]:
    """The dtypes a safetensors file's header declares (read raw: no loader that could cast)."""
    import json
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_engine_and_export_receive_the_model_dtype_not_the_float32_masters(tiny_path, world, tmp_path):
    """--model.dtype bfloat16 in a world of one (no gather): what the engine is sent and what the
    export writes are bf16, while the trainer keeps float32 masters."""
    from minirl import dist, models
    from minirl.run import export_hf
    policy = models.sharded(tiny_path, "policy", world, "bfloat16")
    assert {p.to_local().dtype for p in policy.parameters()} == {torch.float32}
    assert {t.dtype for _, t in dist.full_parameters(policy, torch.bfloat16)} == {torch.bfloat16}
    export_hf(policy, tiny_path, str(tmp_path / "final"), True, torch.bfloat16)
    assert safetensors_dtypes(tmp_path / "final" / "model.safetensors") == {"BF16"}


@pytest.mark.parametrize("cuda_build, says", [(None, "CPU build"), ("13.0", "needs driver 580 or later")])
def test_gpus_that_torch_cannot_use_stop_the_launch_with_one_line(monkeypatch, cuda_build, says):
    """NVIDIA's driver reports GPUs, torch sees none: a CPU torch in the venv, or a driver older than
    torch's CUDA. One line naming which, instead of a run that trains on the host; CUDA_VISIBLE_DEVICES=
    (empty) asks for the CPU on purpose, and a machine without the driver is a CPU machine."""
    from minirl.config import ConfigError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    monkeypatch.setattr(dist, "_nvml", lambda: (8, "550.54.15"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ConfigError, match=f"driver 550.54.15 reports 8 GPU.*{says}.*CUDA_VISIBLE_DEVICES="):
        dist.device_type()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert dist.device_type() == "cpu"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(dist, "_nvml", lambda: None)
    assert dist.device_type() == "cpu"


def test_nvml_probe_answers_none_on_a_machine_without_the_driver():
    assert dist._nvml() is None or torch.cuda.is_available()  # this CPU machine: no libnvidia-ml


class _FakeNVML:
    """libnvidia-ml as ctypes calls it: NVML's return codes (0: success), and what it writes through pointers."""

    def __init__(self, init=0, count=2, driver=b"550.54.15"):
        self.init, self.count, self.driver, self.shut = init, count, driver, False

    def nvmlInit_v2(self):
        return self.init

    def nvmlDeviceGetCount_v2(self, ref):
        ref._obj.value = self.count
        return 0

    def nvmlSystemGetDriverVersion(self, buf, size):
        assert size == len(buf)  # never more than the buffer holds
        buf.value = self.driver
        return 0

    def nvmlShutdown(self):
        self.shut = True


@pytest.mark.parametrize("lib, found", [(None, None), ({}, (2, "550.54.15")), ({"init": 9}, None),
                                        ({"count": 0}, None), ({"driver": b""}, (2, "?"))])
def test_the_nvml_probe_reads_the_gpus_and_the_driver_and_answers_none_where_it_finds_none(monkeypatch, lib, found):
    import ctypes
    fake = None if lib is None else _FakeNVML(**lib)

    def cdll(name):
        if fake is None:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        return fake

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    assert dist._nvml() == found
    assert fake is None or fake.shut == (fake.init == 0)  # a library it started is shut down, whatever it found


def test_a_second_sigterm_stops_at_once_as_a_second_ctrl_c_does(world):
    """The first asks for a save at the step's end; a second must not wait for a step that may never end
    (a reward function that never returns): schedulers send SIGTERM, then SIGKILL."""
    import os
    import signal
    check = dist.sigterm_flag()
    check.armed = True  # the steps have begun (run.Run.steps)
    os.kill(os.getpid(), signal.SIGTERM)
    assert check() and check.name == "SIGTERM"
    with pytest.raises(SystemExit) as e:
        os.kill(os.getpid(), signal.SIGTERM)
    assert e.value.code == 128 + signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.dist
def test_per_rank_decisions_are_the_meshs_where_a_ranks_own_data_would_decide_otherwise():
    """X1 (the token-budget micro-batch count), B19 (the determinism probe's verdict), B12 (a poisoned
    window) and the SIGTERM check, on two ranks whose data differ: each rank alone would decide
    otherwise; both decide as the mesh does."""
    p = torchrun("tests/dist/per_rank_decisions.py")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("X1 micro-batches 3") == 2 and p.stdout.count("B19 mesh-wide verdicts OK") == 2
    assert p.stdout.count("skipped on both") == 2 and p.stdout.count("both stop") == 2


# ---- what dist.py's mutation run found unchecked by its fast tests ----

def test_device_map_refuses_a_rank_outside_the_world_and_a_disaggregated_world_without_rollout_ranks():
    from minirl.dist import device_map
    assert device_map(1, 1, 2, 0, "colocated", "cpu").engine == torch.device("cpu")
    with pytest.raises(ValueError, match="rank 2 outside a world of 2"):
        device_map(2, 0, 2, 0, "colocated", "cpu")
    with pytest.raises(ValueError, match="with 0 rollout rank"):
        device_map(0, 0, 2, 0, "disaggregated", "cpu")
    assert dist.World(0, 2, 0, torch.device("cpu")).is_main and not dist.World(1, 2, 1, torch.device("cpu")).is_main


@pytest.mark.parametrize("spec, due, onward", [
    ("kill_in_save:3", [3], list(range(3, 10))),
    ("kill_in_save:3-5", [3, 4, 5], [3, 4, 5]),
    ("other:1,kill_in_save:0", [0], list(range(10))),
    ("kill_in_save_x:3,kill_in:3", [], []),  # another fault's name, even one that starts like it
])
def test_a_fault_is_due_at_the_steps_its_variable_names(monkeypatch, spec, due, onward):
    monkeypatch.setenv("MINIRL_FAULT", spec)
    assert [s for s in range(10) if dist.fault_due("kill_in_save", s)] == due
    assert [s for s in range(10) if dist.fault_due("kill_in_save", s, onward=True)] == onward


@pytest.mark.parametrize("error, says", [
    (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:29500. This is "
                  "typically a problem\nwith its second line"),
     "global rank 3 lost a peer: Connection closed by peer [10.0.0.2]:29500"),
    (RuntimeError("Connection reset by peer"), "global rank 3 lost a peer: Connection reset by peer"),
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:580] writev [10.0.0.2]:29500: Broken pipe"),
     "global rank 3 lost a peer: writev [10.0.0.2]:29500: Broken pipe"),
])
def test_a_lost_peer_is_named_with_this_rank_and_the_runs_store(monkeypatch, error, says):
    monkeypatch.setitem(dist._here, "rank", 3)
    monkeypatch.setitem(dist._here, "store", "10.0.0.1:29400")
    assert str(dist.lost_peer(error)) == (f"{says}; the run's store is at 10.0.0.1:29400 (global rank 0, on the "
                                          "node MASTER_ADDR names)")
    assert dist.lost_peer(RuntimeError("CUDA out of memory")) is None
    assert dist.lost_peer(BrokenPipeError(32, "Broken pipe")) is None  # a write to a closed pipe: the console's
    monkeypatch.setitem(dist._here, "rank", None)
    monkeypatch.setitem(dist._here, "store", None)
    anonymous = str(dist.lost_peer(error))
    assert anonymous.startswith("this rank lost a peer: ") and "store" not in anonymous


def test_a_first_ctrl_c_asks_for_the_save_and_says_so(world, capfd):
    import signal
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        check = dist.sigterm_flag()
        check.armed = True  # the steps have begun (run.Run.steps)
        assert not check()
        os.kill(os.getpid(), signal.SIGTERM)
        assert check() and check.name == "SIGTERM" and capfd.readouterr().err == ""
        check = dist.sigterm_flag()
        check.armed = True
        os.kill(os.getpid(), signal.SIGINT)
        assert check() and check.name == "Ctrl-C"
        assert "Ctrl-C: saving a checkpoint at the end of this step, then exiting" in capfd.readouterr().err
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


@pytest.mark.parametrize("sig, code, says", [(signal.SIGTERM, 143, "minirl.grpo: stopped by SIGTERM"),
                                              (signal.SIGINT, 130, "minirl.grpo: interrupted (Ctrl-C)")])
def test_a_signal_while_the_engine_builds_stops_at_once_saying_so_on_the_console(tmp_path, sig, code, says):
    """Before the steps there is nothing to save: a SIGTERM or Ctrl-C during the build (minutes on a card) ran on
    through the build and a whole step to save it (a scheduler's grace is often 30 s), told "saving a checkpoint
    at the end of this step". It stops at once, with one line on the console, not in the engine's log (the build
    sends file descriptor 2 there)."""
    script = ("import os, signal, sys, time\n"
              "from minirl import dist, launch\n"
              "from minirl.rollout import _engine_output\n"
              "def main(argv):\n"
              "    dist.sigterm_flag()\n"
              "    with _engine_output(sys.argv[1]):  # as the engine's build\n"
              f"        os.kill(os.getpid(), {int(sig)})\n"
              "        time.sleep(60)\n"
              "launch.run('minirl.grpo', main)\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", script, str(tmp_path / "engine.log")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == code and p.stderr.strip().splitlines()[-1] == says, p.stderr
    assert time.monotonic() - t0 < 50 and (tmp_path / "engine.log").read_text() == ""


def test_ranks_on_one_host_share_its_cores_and_a_private_world_is_restored(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    try:
        dist.place(torch.device("cpu"), 4, 0, None)
        assert torch.get_num_threads() == 2
        dist.place(torch.device("cpu"), 16, 0, None)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/cache")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with dist.private_world(torch.device("cpu")):
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
        assert os.environ["VLLM_CACHE_ROOT"] == "/cache/minirl-rank5"
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["VLLM_CACHE_ROOT"]) == ("5", "2", "/cache")
    monkeypatch.delenv("RANK")
    with dist.private_world(torch.device("cpu")):
        assert os.environ["VLLM_CACHE_ROOT"] == "/cache/minirl-rank0"
    assert "RANK" not in os.environ


def test_deterministic_mode_turns_on_torchs_deterministic_kernels():
    try:
        dist.set_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False



class _Broadcasts:
    """A refit group of one (no process group): a send keeps each buffer; given `sent`, a receive gets them back."""

    device = torch.device("cpu")

    def __init__(self, sent=()):
        self.sent, self._replay, self.events = [], iter(sent), []  # events: "start k" and "wait k", bucket k

    def broadcast(self, buf, src=0):
        arrived = next(self._replay, None)
        if arrived is None:
            self.sent.append(buf.clone())
        else:
            buf.copy_(arrived)  # a buffer of another size than the one sent fails here
        k = sum(e.startswith("start") for e in self.events)
        self.events.append(f"start {k}")
        return SimpleNamespace(wait=lambda: self.events.append(f"wait {k}"))


def test_the_refit_group_on_the_host_is_gloo_and_its_broadcast_reaches_every_member():
    """refit_group, built on the run's store outside torch's registry: gloo for host tensors (NCCL is for
    CUDA's), member 0's bucket arriving at member 1 (two members in threads of this process), and a tensor
    of another device type refused by name."""
    store, got = torch.distributed.HashStore(), {}

    def member(rank):
        group = refit.refit_group(store, rank, 2, torch.device("cpu"), timeout=datetime.timedelta(seconds=60))
        bucket = torch.arange(8, dtype=torch.uint8) if rank == 0 else torch.zeros(8, dtype=torch.uint8)
        group.broadcast(bucket, src=0).wait()
        got[rank] = type(group.backend).__name__, bucket.tolist()
        with pytest.raises(RuntimeError, match="refit group: a meta tensor on a group of cpu members"):
            group.broadcast(torch.zeros(1, device="meta"), src=0)

    members = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for m in members:
        m.start()
    for m in members:
        m.join(timeout=90)
    assert got == {r: ("ProcessGroupGloo", list(range(8))) for r in (0, 1)}


def test_the_refit_sends_the_manifests_parameters_and_refuses_any_other(monkeypatch):
    """send packs each parameter at its manifest offset, bucket by bucket, and receive reads them back; a
    parameter of another dtype or shape than the manifest's, or one more than it lists, is refused by name."""
    monkeypatch.setattr(refit, "BUCKET_BYTES", 64)  # several buckets of a tiny model
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    buckets = refit.manifest(model, torch.bfloat16)
    # 16-byte aligned: 0.weight 24 -> 32, 0.bias 6 -> 16, 1.weight 12 -> 16 fill the 64; 1.bias opens the next
    assert [(b["nbytes"], [e[0] for e in b["entries"]]) for b in buckets] == [
        (64, ["0.weight", "0.bias", "1.weight"]), (16, ["1.bias"])]
    named = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
    trainer = _Broadcasts()
    assert refit.send(trainer, buckets, iter(named)) == sum(b["nbytes"] for b in buckets) and len(trainer.sent) > 1
    received = refit.receive(_Broadcasts(trainer.sent), buckets)
    assert [(n, t.tolist()) for n, t in received] == [(n, t.tolist()) for n, t in named]
    wrong = [(n, t.float() if n == "1.weight" else t) for n, t in named]
    with pytest.raises(RuntimeError, match=r"refit: parameter 1\.weight \(2, 3\) torch\.float32 does not match the "
                                           r"manifest's 1\.weight \(2, 3\) torch\.bfloat16"):
        refit.send(_Broadcasts(), buckets, iter(wrong))
    with pytest.raises(RuntimeError, match="more parameters than the manifest"):
        refit.send(_Broadcasts(), buckets, iter(named + [("2.weight", named[0][1])]))


def test_the_refit_fills_a_bucket_to_its_last_byte_and_keeps_two_buckets_on_the_wire(monkeypatch):
    """Five 32-byte parameters in 64-byte buckets: two fill a bucket exactly, the fifth opens a third. The
    sender waits for bucket k once bucket k + 1 is on the wire (at most two in flight, each buffer alive until
    its broadcast is done); the receiver starts bucket k + 1 before it reads bucket k's parameters."""
    monkeypatch.setattr(refit, "BUCKET_BYTES", 64)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4, bias=False) for _ in range(5)))  # 16 x 2 bytes each
    buckets = refit.manifest(model, torch.bfloat16)
    assert [(b["nbytes"], [e[0] for e in b["entries"]]) for b in buckets] == [
        (64, ["0.weight", "1.weight"]), (64, ["2.weight", "3.weight"]), (32, ["4.weight"])]
    named = [(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()]
    trainer = _Broadcasts()
    refit.send(trainer, buckets, iter(named))
    assert trainer.events == ["start 0", "start 1", "wait 0", "start 2", "wait 1", "wait 2"]
    rollout = _Broadcasts(trainer.sent)
    got = []
    for name, t in refit.receive(rollout, buckets):
        rollout.events.append(f"got {name}")
        got.append(t.tolist())
    assert rollout.events == ["start 0", "start 1", "wait 0", "got 0.weight", "got 1.weight", "start 2", "wait 1",
                              "got 2.weight", "got 3.weight", "wait 2", "got 4.weight"]
    assert got == [t.tolist() for _, t in named]
