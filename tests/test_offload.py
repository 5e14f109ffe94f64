"""offload.py: the trainer's offload round trip and the colocated hand-off, with an instrumented
engine that records calls (B20-B26). The same cycle with the real engine: test_checkpoint.py."""

import pytest
import torch

from conftest import cuda, toy_lm
from minirl import dist
from minirl.config import RolloutConfig
from minirl.offload import HandOff, TrainerOffload
from minirl.rollout import Engine

CYCLE = ["rollout.sleep", "trainer.onload", "rollout.wake_up(weights)", "weight_sync", "trainer.offload",
         "rollout.wake_up(kv_cache)"]


class RecordingEngine(Engine):
    """The real Engine's sleep/wake state machine without vLLM; every call lands in `log` (and, for a
    ScriptedEngine, each sampling call's prompt ids, a group's once, in `sampled`)."""

    def __post_init__(self):
        self._vllm_sleeps, self.log, self.fail_sleep, self.sampled = False, [], False, []

    def sleep(self, level=None):
        if self.fail_sleep:
            raise RuntimeError("sleep failed")
        self.log.append(f"sleep:{level}")
        super().sleep(level)

    def wake_up(self, tags):
        self.log.append(f"wake:{'+'.join(tags)}")
        super().wake_up(tags)

    def load_weights(self, named_tensors):
        assert self.state != "asleep", "weight sync while asleep"
        n = sum(1 for _ in named_tensors)
        self._stale = False
        self.loads += 1
        self.log.append("load_weights")
        return n

    def generate(self, *a, **k):
        if self.state != "awake" or self._stale:
            raise RuntimeError(f"generate while {self.state}")
        self.log.append("generate")


def trainer(world, seed=0):
    model = toy_lm(seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()  # optimizer state exists
    model(torch.tensor([[3, 2, 1]])).sum().backward()  # and gradients
    return model, opt


def snapshot(model, opt):
    out = [p.detach().clone() for p in model.parameters()] + [p.grad.clone() for p in model.parameters()]
    return out + [v.clone() for s in opt.state.values() for v in s.values()]


def test_offload_round_trip_is_bit_exact_and_releases_storage(world):
    model, opt = trainer(world)
    before = snapshot(model, opt)
    off = TrainerOffload(model, opt)
    off.offload()
    off.offload()  # idempotent
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(s["exp_avg"].untyped_storage().nbytes() == 0 for s in opt.state.values())
    off.onload()
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, opt)))


def test_offload_holds_one_exact_size_host_buffer_pinned_once_for_the_run(world, monkeypatch):
    """The host copy of an offloaded trainer is ONE buffer of the storages' logical size (each slice
    aligned to 64 bytes), page-locked in place once (cudaHostRegister: no power-of-two rounding of
    torch's caching host allocator) and reused by every later offload, bit-exact each time."""
    model, opt = trainer(world)
    before = snapshot(model, opt)
    registered = []

    class CudaRuntime:
        def cudaHostRegister(self, ptr, nbytes, flags):
            registered.append((ptr, nbytes))
            return 0

        def cudaHostUnregister(self, ptr):
            registered.remove(next(r for r in registered if r[0] == ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: CudaRuntime())
    storages = {}
    for t in [*model.parameters(), *(p.grad for p in model.parameters()),
              *(v for st in opt.state.values() for v in st.values() if v.numel() > 1)]:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[local.untyped_storage()._cdata] = local.untyped_storage().nbytes()
    logical = sum(-(-n // 64) * 64 for n in storages.values())
    off = TrainerOffload(model, opt)
    for _ in range(3):
        off.offload()
        assert off.buffer.numel() == logical and registered == [(off.buffer.data_ptr(), logical)]
        off.onload()
        assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, opt)))
    assert logical < 1.2 * sum(storages.values())  # the alignment costs next to nothing


def test_offload_can_keep_gradients_resident(world):
    model, opt = trainer(world)
    off = TrainerOffload(model, opt, keep_grads=True)
    off.offload()
    assert all(p.grad.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    off.onload()
    model.zero_grad(set_to_none=True)  # no gradients yet (before the first backward): nothing to keep
    off.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    off.onload()


def test_gradients_sharing_parameter_storage_are_refused_before_offload(world):
    """S20: a trainer that cannot keep gradients resident while its parameters are offloaded is refused."""
    model, opt = trainer(world)
    p = next(model.parameters())
    p.grad = p.detach()  # a gradient living in its parameter's storage
    before = [q.detach().clone() for q in model.parameters()]
    with pytest.raises(RuntimeError, match="cannot keep gradients resident"):
        TrainerOffload(model, opt, keep_grads=True).offload()
    assert all(q.untyped_storage().nbytes() > 0 for q in model.parameters())  # refused before releasing anything
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fsdp2_parameters_round_trip(world, tiny_path):
    from minirl.models import load_policy
    model = dist.shard(load_policy(tiny_path), world, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.full_tensor().clone() for p in model.parameters()]
    off = TrainerOffload(model, opt)
    off.offload()
    assert all(p.to_local().untyped_storage().nbytes() == 0 for p in model.parameters())
    off.onload()
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.isfinite().all()


def test_training_through_offloads_matches_training_without(world):
    a, opt_a = trainer(world)
    b, opt_b = trainer(world)
    off = TrainerOffload(b, opt_b)
    for i in range(3):
        off.offload()
        off.onload()
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            m(torch.tensor([[i, 2, 4]])).pow(2).mean().backward()
            o.step()
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def handoff(world, enabled=True, level=1):
    model, opt = trainer(world)
    eng = RecordingEngine("unused", RolloutConfig(sleep_level=level), 32, torch.device("cpu"))
    h = HandOff(eng, TrainerOffload(model, opt), lambda: iter(model.named_parameters()), enabled, level)
    return h, eng


def test_cycle_order(world):
    h, eng = handoff(world)
    h.start_fresh()
    for _ in range(2):
        eng.generate()
        h.to_trainer()
        assert eng.state == "asleep" and not h.trainer.offloaded
        h.publish()
        assert eng.state == "awake" and h.trainer.offloaded
    assert h.events == ["trainer.offload"] + CYCLE * 2
    assert eng.log == ["generate", "sleep:1", "wake:weights", "load_weights", "wake:kv_cache"] * 2


def test_scheduled_save_runs_inside_the_update_window_before_publication(world):
    h, eng = handoff(world)
    h.start_fresh()
    h.to_trainer()

    def save():
        assert eng.state == "asleep" and not h.trainer.offloaded

    h.save_in_update_window(save)
    h.publish()
    assert eng.loads == 1  # the step publishes once
    assert h.events[-7:] == CYCLE[:2] + ["checkpoint.save"] + CYCLE[2:]


def test_validation_save_after_publication_at_level_2_sleeps_rollout_and_resyncs(world):
    h, eng = handoff(world, level=2)
    h.start_fresh()
    h.to_trainer()
    h.publish()
    eng.generate()  # validation
    h.save_after_publication(lambda: None)
    assert h.events[-7:] == CYCLE[:2] + ["checkpoint.save"] + CYCLE[2:]
    assert eng.log[-4:] == ["sleep:2", "wake:weights", "load_weights", "wake:kv_cache"]
    eng.generate()  # only possible because the full sync ran before the KV cache woke


def test_validation_save_after_publication_at_level_1_wakes_without_a_second_sync(world):
    """Level 1 keeps the engine's weights on the host: they come back unchanged, so the step's one
    publication stands (B23 asks for the re-sync after a level-2 save only)."""
    h, eng = handoff(world, level=1)
    h.start_fresh()
    h.to_trainer()
    h.publish()
    h.save_after_publication(lambda: None)
    assert h.events[-6:] == CYCLE[:2] + ["checkpoint.save", "rollout.wake_up(weights)", "trainer.offload",
                                        "rollout.wake_up(kv_cache)"]
    assert eng.loads == 1 and eng.log[-3:] == ["sleep:1", "wake:weights", "wake:kv_cache"]
    eng.generate()


def test_failed_save_leaves_rollout_asleep(world):
    h, eng = handoff(world)
    h.start_fresh()
    h.to_trainer()
    h.publish()

    def bad_save():
        raise OSError("disk full")

    with pytest.raises(OSError):
        h.save_after_publication(bad_save)
    assert eng.state == "asleep"
    h.cleanup()  # idempotent
    assert eng.state == "asleep"


def test_sleep_after_weights_only_wake_releases_weights_again(world):
    h, eng = handoff(world)
    h.to_trainer()
    eng.wake_up(["weights"])
    h.cleanup()
    assert eng.state == "asleep" and eng.log[-1] == "sleep:1"


def test_original_error_survives_a_failing_cleanup(world, capsys):
    h, eng = handoff(world)
    eng.fail_sleep = True
    with pytest.raises(ValueError, match="training broke"):
        try:
            raise ValueError("training broke")
        except BaseException:
            h.cleanup()
            raise
    assert "cleanup after an error also failed" in capsys.readouterr().err


def test_resume_sleeps_engine_before_restore_and_publishes_first(world):
    h, eng = handoff(world)
    h.before_restore()
    assert eng.state == "asleep"  # the checkpoint loads here
    h.publish()
    eng.generate()
    assert h.events == ["rollout.sleep", *CYCLE[2:]]
    assert eng.log == ["sleep:1", "wake:weights", "load_weights", "wake:kv_cache", "generate"]


def test_colocated_offload_false_only_syncs(world):
    h, eng = handoff(world, enabled=False)
    h.start_fresh()
    h.to_trainer()
    h.publish()
    assert h.events == ["weight_sync"] and not h.trainer.offloaded
    assert eng.log == ["load_weights"]
    h.save_after_publication(lambda: eng.log.append("save"))  # saved in place: nothing slept, nothing changed
    h.cleanup()  # a failure: the engine was never put to sleep, so it is not now
    assert h.events == ["weight_sync", "checkpoint.save"] and eng.log == ["load_weights", "save"]
    assert eng.state == "awake" and not h.trainer.offloaded


@pytest.mark.gpu
@cuda
def test_offload_frees_device_memory_and_onload_restores_it():
    model = torch.nn.Linear(4096, 4096, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 4096, device="cuda")).sum().backward()
    opt.step()
    before = [t.clone().cpu() for t in snapshot(model, opt)]
    held = torch.cuda.memory_allocated()
    off = TrainerOffload(model, opt)
    off.offload()
    freed = held - torch.cuda.memory_allocated()
    print(f"offload freed {freed / 2**20:.0f} MiB of {held / 2**20:.0f} MiB")
    assert freed >= 4 * 4096 * 4096 * 4 * 0.99  # params, grads, exp_avg, exp_avg_sq
    off.onload()
    assert torch.cuda.memory_allocated() >= held - 2**20
    assert all(torch.equal(a, b.cpu()) for a, b in zip(before, snapshot(model, opt)))


class RecordedLLM:
    """Stands in for vllm.LLM's sleep and wake_up, counting what really reaches vLLM."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(f"sleep:{level}")

    def wake_up(self, tags):
        self.calls.append("wake:" + "+".join(tags))


def test_a_second_sleep_adds_nothing(world):
    """B24: sleep is idempotent: asleep, a second sleep reaches neither vLLM nor the engine's events;
    after a weights-only wake, sleep releases the weights again."""
    eng = RecordingEngine("unused", RolloutConfig(), 32, torch.device("cpu"))
    eng._vllm_sleeps, eng.llm = True, RecordedLLM()
    eng.sleep(1)
    eng.sleep(1)
    assert eng.llm.calls == ["sleep:1"] and list(eng.events) == ["sleep:1"]
    eng.wake_up(["weights"])
    eng.sleep(1)
    assert eng.llm.calls == ["sleep:1", "wake:weights", "sleep:1"] and eng.state == "asleep"


def test_restore_sleeps_the_engine_loads_then_publishes(world):
    """B25 as the entrypoints run it (`HandOff.restore`): the engine sleeps before the checkpoint
    loads, and the restored policy is published before any sampling."""
    h, eng = handoff(world)
    state = h.restore(lambda: (eng.log.append("checkpoint.load"), {"steps_done": 3})[1])
    eng.generate()
    assert state == {"steps_done": 3}
    assert h.events == ["rollout.sleep", "checkpoint.load", *CYCLE[2:]]
    assert eng.log == ["sleep:1", "checkpoint.load", "wake:weights", "load_weights", "wake:kv_cache", "generate"]


class FailingEngine(RecordingEngine):
    """What `grpo.main` builds in place of vLLM: the hand-off runs for real, the first generate fails
    (the run's own error), and `close` fails too."""

    def generate(self, *a, **k):
        super().generate()
        raise RuntimeError("the run's own error")

    def close(self):
        raise RuntimeError("close failed as well")


def grpo_main_with(engine_cls, monkeypatch, tmp_path, *flags):

    from minirl import grpo
    built = []
    monkeypatch.setattr(grpo, "Engine", lambda *a, **k: built.append(engine_cls(*a, **k)) or built[-1])
    with pytest.raises(RuntimeError) as raised:
        grpo.main(["--steps", "3", "--rl.batch-per-replica", "4", "--rl.group-size", "2", "--log.eval-every", "0",
                   "--log.run-dir", str(tmp_path / "run"), *flags])
    return raised.value, built[0]


def test_a_failing_grpo_run_whose_engine_close_fails_too_raises_its_own_error(world, tmp_path, monkeypatch, capsys):
    """B24 through grpo.main: the engine's failing `close` is reported, the run's error is the one raised."""
    err, engine = grpo_main_with(FailingEngine, monkeypatch, tmp_path)
    assert str(err) == "the run's own error"
    assert "cleanup after an error also failed: RuntimeError: close failed as well" in capsys.readouterr().err
    assert engine.state == "asleep"  # the clean-up put the engine to sleep


def test_a_resumed_grpo_run_sleeps_the_engine_loads_then_publishes_before_sampling(world, tiny_path, tmp_path,
                                                                                   monkeypatch):
    """B25 through grpo.main: the first hand-off of a resumed run is sleep, checkpoint load, publish
    (weights woken, loaded, KV cache woken), and only then the first generate."""
    from minirl import checkpoint, models
    policy = models.sharded(tiny_path, "policy", world, "float32")
    ckpt = checkpoint.save(str(tmp_path / "ckpt"), 1, {"policy": (policy, models.adamw(policy, 1e-4, 0.01))},
                           {"optimizer_steps": 1, "skipped": 0, "probe_done": False}, keep=2)
    load = checkpoint.load
    engines = []
    monkeypatch.setattr(checkpoint, "load", lambda *a, **k: (engines[0].log.append("load"), load(*a, **k))[1])

    class Recorded(FailingEngine):
        def __post_init__(self):
            super().__post_init__()
            engines.append(self)

    grpo_main_with(Recorded, monkeypatch, tmp_path, "--checkpoint.resume", ckpt)
    assert engines[0].log[:6] == ["sleep:1", "load", "wake:weights", "load_weights", "wake:kv_cache", "generate"]


class ScriptedEngine(RecordingEngine):
    """Made-up samples (random completions), so grpo.main's whole loop runs without vLLM."""

    def generate(self, prompts, prompt_ids, group_size, greedy=False, max_tokens=None):
        from minirl.rollout import Samples
        super().generate()  # recorded; refused unless awake with fresh weights
        if not greedy:
            self.sampled.append(list(dict.fromkeys(prompt_ids)))
        g = torch.Generator().manual_seed(sum(prompt_ids) + len(self.log))
        rows = len(prompts) * group_size
        lengths = torch.randint(1, 5, (rows,), generator=g).tolist()
        comps = [torch.randint(3, 30, (n,), generator=g).tolist() for n in lengths]
        each = lambda xs: [x for x in xs for _ in range(group_size)]  # noqa: E731  (row i*G + j is prompt i's)
        return Samples(each(prompt_ids), each(prompts), comps, [[-1.0] * n for n in lengths], ["stop"] * rows)

    def close(self):
        pass


def test_a_scheduled_save_at_a_boundary_without_validation_runs_before_publication(world, tmp_path, monkeypatch):
    """B22 through grpo.main: every step's checkpoint is written while the engine sleeps and the trainer
    holds the card, before the step's one publication; no second sleep for it."""

    from minirl import checkpoint, grpo
    built = []
    monkeypatch.setattr(grpo, "Engine", lambda *a, **k: built.append(ScriptedEngine(*a, **k)) or built[-1])
    save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda *a, **k: (built[0].log.append("save"), save(*a, **k))[1])
    grpo.main(["--steps", "2", "--rl.batch-per-replica", "4", "--rl.group-size", "2", "--log.eval-every", "0",
               "--checkpoint.every", "1", "--log.run-dir", str(tmp_path / "run")])
    step = ["generate", "sleep:1", "save", "wake:weights", "load_weights", "wake:kv_cache"]
    assert built[0].log == step * 2 + ["sleep:1"]  # the end hands the card to the export


def record_residency(monkeypatch, log: list) -> None:
    """Every TrainerOffload move that changes where a model is lands in `log` as `onload:<kind>` or
    `offload:<kind>` (policy, value, ref: the one without an optimizer)."""
    from minirl.models import ValueModel
    kind = lambda o: "value" if isinstance(o.model, ValueModel) else "ref" if o.optimizer is None else "policy"  # noqa: E731
    onload, offload = TrainerOffload.onload, TrainerOffload.offload
    monkeypatch.setattr(TrainerOffload, "onload",
                        lambda self: (self.offloaded and log.append(f"onload:{kind(self)}"), onload(self))[1])
    monkeypatch.setattr(TrainerOffload, "offload",
                        lambda self: (self.offloaded or log.append(f"offload:{kind(self)}"), offload(self))[1])


def on_card_while_awake(log: list, built: set) -> list:
    """The events at which some model of the trainer (all of `built` are on the card when built) was
    resident while the engine was awake: from a generate or its KV cache's wake until it sleeps."""
    resident, awake, bad = set(built), False, []
    for e in log:
        what = e.split(":", 1)[-1]
        if e.startswith("onload:"):
            resident.add(what)
        elif e.startswith("offload:"):
            resident.discard(what)
        elif e in ("generate", "wake:kv_cache"):
            awake = True
        elif e.startswith("sleep:"):
            awake = False
        if awake and resident:
            bad.append(f"{e} with {sorted(resident)} on the card")
    return bad


def test_colocated_grpo_offloads_the_reference_too_while_the_engine_is_awake(world, tmp_path, monkeypatch):
    """With a KL reference, nothing of the trainer stays on the card while the engine is awake: the
    frozen reference leaves with the policy and its optimizer, and comes back with them."""
    from minirl import grpo
    built = []
    monkeypatch.setattr(grpo, "Engine", lambda *a, **k: built.append(ScriptedEngine(*a, **k)) or built[-1])
    log = []
    monkeypatch.setattr(ScriptedEngine, "__post_init__", lambda self: (RecordingEngine.__post_init__(self),
                                                                       setattr(self, "log", log))[0])
    record_residency(monkeypatch, log)
    grpo.main(["--steps", "2", "--rl.batch-per-replica", "4", "--rl.group-size", "2", "--log.eval-every", "0",
               "--rl.kl-coef", "0.1", "--log.run-dir", str(tmp_path / "run")])
    assert on_card_while_awake(log, {"policy", "ref"}) == []
    assert log.count("onload:ref") == log.count("onload:policy") == 3  # two updates and the export
