"""The colocated hand-off: who holds the card while the rollout or the trainer runs (rules B20-B27 in
docs/invariants.md). One colocated step (B20):

    generate -> rollout.sleep -> trainer.onload -> train -> rollout.wake_up(weights)
             -> weight_sync -> trainer.offload -> rollout.wake_up(kv_cache) -> next generate

- `TrainerOffload` moves a model's parameters, gradients and optimizer state to one host buffer and
  back, bit-exactly, by storage: each storage is copied to its slice and resized to 0 bytes (so the
  release is real, even on CPU), and onload restores it under every view (FSDP2's shards are views).
  The buffer is page-locked in place once on CUDA, not one pinned tensor per storage (torch's
  caching host allocator rounds each up to a power of two). `Together` moves several as one.
- `HandOff` drives the engine and the trainer in that order, and owns the checkpoint windows
  (B22-B23) and the exceptional exit (B24); disabled, it only syncs the weights (B26).
"""

from __future__ import annotations

import torch

from minirl import dist


class TrainerOffload:
    """One model's (and its optimizer's, if it has one: the frozen reference has none) device memory."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 keep_grads: bool = False):
        self.model, self.optimizer, self.keep_grads = model, optimizer, keep_grads
        self.buffer: torch.Tensor | None = None  # (bytes,) uint8 on the host, kept for the run
        self.slices: list[tuple[torch.UntypedStorage, int, int]] = []  # each offloaded storage: offset, bytes
        self.offloaded = False

    def _tensors(self):
        for p in self.model.parameters():
            yield p.to_local() if hasattr(p, "to_local") else p
            if p.grad is not None and not self.keep_grads:
                g = p.grad
                yield g.to_local() if hasattr(g, "to_local") else g
        for state in self.optimizer.state.values() if self.optimizer is not None else ():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:  # AdamW's scalar `step` stays
                    yield v.to_local() if hasattr(v, "to_local") else v

    @torch.no_grad()
    def offload(self) -> None:
        if self.offloaded:
            return
        if self.keep_grads:
            self._check_grads_survive()
        storages = {}  # by storage identity (_key): views of one storage are copied once
        for t in self._tensors():
            s = t.untyped_storage()
            if s.nbytes():
                storages.setdefault(_key(s), s)
        self.slices, end = [], 0
        for s in storages.values():
            self.slices.append((s, end, s.nbytes()))
            end += -(-s.nbytes() // ALIGN) * ALIGN
        if self.buffer is None or self.buffer.numel() < end:
            self.buffer = _host_buffer(end, self.buffer)
        for s, at, n in self.slices:
            self.buffer[at:at + n].copy_(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s))
        for s, _, _ in self.slices:
            s.resize_(0)
        self.offloaded = True

    def _check_grads_survive(self) -> None:
        """Refuse a trainer whose gradients share its parameters' storage: they would be lost here."""
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        params = {_key(local(p).untyped_storage()): n for n, p in self.model.named_parameters()
                  if local(p).untyped_storage().nbytes()}
        for p in self.model.parameters():
            if p.grad is None or not local(p.grad).untyped_storage().nbytes():
                continue
            name = params.get(_key(local(p.grad).untyped_storage()))
            if name is not None:
                raise RuntimeError(f"offload: the gradients share storage with parameter {name!r}, so this trainer "
                                   "cannot keep gradients resident while its parameters are offloaded (S20); give gradients their own storage, as "
                                   "minirl's FSDP2 trainer does (dist.shard)")

    @torch.no_grad()
    def onload(self) -> None:
        if not self.offloaded:
            return
        for s, at, n in self.slices:
            s.resize_(n)
            torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).copy_(self.buffer[at:at + n])
        self.slices = []
        self.offloaded = False


class Together:
    """Several models moved as one: what a colocated rank's trainer holds (the policy with its
    optimizer, the frozen reference, PPO's critic) leaves the card while the engine is awake."""

    def __init__(self, *parts: TrainerOffload):
        self.parts = parts

    def offload(self) -> None:
        for p in self.parts:
            p.offload()

    def onload(self) -> None:
        for p in self.parts:
            p.onload()


ALIGN = 64  # bytes: each storage's slice of the host buffer starts on a cache line


def _host_buffer(nbytes: int, old: torch.Tensor | None) -> torch.Tensor:
    """A host buffer of exactly `nbytes`, page-locked in place on CUDA so copies to and from the card run
    at full speed (an older, smaller one is released first)."""
    pin = torch.cuda.is_available()
    if old is not None and pin:
        torch.cuda.cudart().cudaHostUnregister(old.data_ptr())
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pin and nbytes:
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(err[0] if isinstance(err, tuple) else err) != 0:
            raise RuntimeError(f"offload: cudaHostRegister of {nbytes / 2**30:.1f} GiB of host memory failed ({err})")
    return buffer


def _key(s: torch.UntypedStorage) -> int:
    """A storage's identity: the address of its StorageImpl, which every view shares. Not `data_ptr()`:
    that is 0 for every storage released to 0 bytes and for every fake tensor (the CPU rehearsal)."""
    return s._cdata


class HandOff:
    """The colocated step cycle and checkpoint windows (B20-B26); every call is recorded in `events`."""

    def __init__(self, engine, trainer: TrainerOffload | None, weights, enabled: bool, sleep_level: int = 1,
                 mark=None):
        self.engine, self.trainer, self.weights = engine, trainer, weights  # weights(): (name, tensor) iterator
        self.enabled, self.level, self.mark = enabled, sleep_level, mark  # mark(name): the run log's profile
        self.events: list[str] = []

    def _do(self, name: str, fn, *a) -> None:
        self.events.append(name)
        fn(*a)
        if self.mark is not None:
            self.mark(name)

    def start_fresh(self) -> None:
        """A fresh run built engine and trainer side by side; the trainer leaves the card before the first draw."""
        if self.enabled:
            self._do("trainer.offload", self.trainer.offload)

    def before_restore(self) -> None:
        """A resumed run: the engine sleeps before the trainer loads its checkpoint (B25); `publish` follows."""
        if self.enabled:
            self._do("rollout.sleep", self.engine.sleep, self.level)

    def restore(self, load):
        """A resumed run's start (B25): the engine sleeps, `load()` restores the trainer, and the
        restored policy is published before any sampling. Returns what `load()` returns."""
        self.before_restore()
        out = []
        self._do("checkpoint.load", lambda: out.append(load()))
        self.publish()
        return out[0]

    def to_trainer(self) -> None:
        """generate -> rollout.sleep -> trainer.onload"""
        if self.enabled:
            self._do("rollout.sleep", self.engine.sleep, self.level)
            self._do("trainer.onload", self.trainer.onload)

    def publish(self) -> None:
        """rollout.wake_up(weights) -> weight_sync -> trainer.offload -> rollout.wake_up(kv_cache)"""
        if self.enabled:
            self._do("rollout.wake_up(weights)", self.engine.wake_up, ["weights"])
        self._do("weight_sync", lambda: self.engine.load_weights(self.weights()))
        if self.enabled:
            self._do("trainer.offload", self.trainer.offload)
            self._do("rollout.wake_up(kv_cache)", self.engine.wake_up, ["kv_cache"])

    def save_in_update_window(self, save) -> None:
        """A scheduled save at a boundary that does not validate: the engine is still asleep and the
        trainer resident, so it runs before publication and the step publishes once (B22)."""
        self._do("checkpoint.save", save)

    def save_after_publication(self, save) -> None:
        """Validation and emergency saves (B23): the rollout sleeps again and the trainer comes back for a
        window of its own; a failed save leaves the rollout asleep. After a level-2 sleep a full weight sync
        follows; at level 1 the engine's own copy comes back."""
        self.to_trainer()
        self._do("checkpoint.save", save)  # raises with the rollout asleep
        if not self.enabled:
            return  # the engine never slept and the weights did not change
        if self.level == 2:
            self.publish()  # the weights were discarded: a full sync before the KV cache wakes
            return
        self._do("rollout.wake_up(weights)", self.engine.wake_up, ["weights"])
        self._do("trainer.offload", self.trainer.offload)
        self._do("rollout.wake_up(kv_cache)", self.engine.wake_up, ["kv_cache"])

    def cleanup(self) -> None:
        """On an exceptional exit: the rollout to sleep, never raising (B24)."""
        if not self.enabled:
            return
        dist.quietly(lambda: self._do("rollout.sleep", self.engine.sleep, self.level))  # reported, not raised
