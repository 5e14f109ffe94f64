"""train_pump: one PPO step consumed as streamed chunks of completed groups, in the order the spec
fixes (rules S5-S15, S19 in docs/invariants.md; the walk-through is docs/guide-streaming.md).

- `TrainPump.chunk(c)` (S5-S7, S12): value forward with the step's UNCHANGED critic (the old values,
  kept for every critic epoch) -> policy (and reference) forward -> GAE -> policy backward into the
  step's open accumulator window; nothing steps between chunks. The policy is offloaded with its
  gradients resident while the critic runs, and the critic is resident again before the caller
  waits for the next chunk.
- `TrainPump.close()` (S8-S11, S13-S15): refuse a step whose every token is masked; one policy step
  per epoch, scaled by the whole step's valid tokens; the refit; then the critic's epochs against the
  frozen returns (colocated full batch: the refit after them). The caller releases the groups after.
- pi_old is the trainer's own logprob at the step's starting weights (as verl's `old_log_prob`), or
  the engine's under `use_rollout_logprobs`; advantages are whitened per chunk (S19).

Shapes: a chunk is a dict of (B_c, T) tensors `input_ids`, `mask`, `rewards` (the sequence reward on
its last completion token), optional `rollout_logp`, and `lengths` (B_c host ints). Everything the
pump keeps for the close is on the trainer's device (`batch.to_device`, once per chunk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from minirl import dist
from minirl.accumulator import Accumulator, roll_up
from minirl.batch import to_device
from minirl.gae import compute_gae, masked_whiten
from minirl.models import token_logprobs
from minirl.objective import logprob_gap, policy_loss, value_loss
from minirl.offload import TrainerOffload


@dataclass
class PumpConfig:
    gamma: float = 1.0
    lam: float = 0.95
    loss: dict = field(default_factory=dict)  # the policy loss's options, as config.OptimConfig.loss_options gives them
    value_clip_eps: float = 0.2
    value_max_grad_norm: float = 1.0  # clip the critic's gradient norm (0 = no clip)
    normalize_advantages: bool = True
    critic_ppo_epochs: int = 1
    policy_micro_rows: int = 0       # rows per policy forward/backward within a chunk; 0 = the whole chunk
    critic_micro_rows: int = 0       # rows per critic forward/backward; 0 = the whole batch
    critic_warmup: bool = False      # this step only trains the critic (S14)
    offload: bool = True             # switch residency between policy and value (S7, S12)
    ppo_epochs: int = 1              # policy epochs; > 1 only in full-batch mode (config_ppo.PPOArgs.validate)
    refit_after_critic: bool = False # colocated full batch: the engine sleeps through critic training (S13)
    value_ready_early: bool = True   # S12: the critic resident before the first chunk; not where an engine
                                     # shares the card (colocated), which generates with the trainer offloaded
    use_rollout_logprobs: bool = False  # pi_old from the engine instead of the trainer


@dataclass
class TrainPump:
    policy: torch.nn.Module
    value: torch.nn.Module
    policy_acc: Accumulator          # opened with n_micro=None: one window for the whole step
    value_opt: torch.optim.Optimizer
    cfg: PumpConfig
    step: int
    refit: object = None             # callable: publish the stepped policy to the rollout ranks (S9)
    ref: torch.nn.Module | None = None
    value_schedule: object = None    # the critic's learning rate per optimizer step (accumulator.lr_schedule)
    log: object = print
    policy_off: TrainerOffload | None = None
    value_off: TrainerOffload | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # the trainer's device
    chunks: list[dict] = field(default_factory=list)   # the assembled batch, with old values and returns
    calls: list[dict] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    last_chunk_s: float = 0.0        # wall time of the latest chunk's work (the tail benchmark's ideal)

    def __post_init__(self):
        self._skipped_before = self.policy_acc.skipped
        # A run creates the offloaders once and hands them to every step's pump: the host copies
        # of whatever the previous step left offloaded live in them.
        if self.cfg.offload and self.policy_off is None:
            self.policy_off = TrainerOffload(self.policy, self.policy_acc.optimizer, keep_grads=True)
            self.value_off = TrainerOffload(self.value, self.value_opt)
        if self.cfg.value_ready_early:
            self.prepare_value()

    # ---- residency ----
    def prepare_value(self) -> None:
        """Value model resident, policy parameters and optimizer state on the host, gradients kept."""
        if self.cfg.offload:
            self.policy_off.offload()
            self.value_off.onload()
        self.events.append("value.ready")

    def _policy_resident(self) -> None:
        if self.cfg.offload:
            self.value_off.offload()
            self.policy_off.onload()
        self.events.append("policy.ready")

    # ---- per chunk ----
    def chunk(self, c: dict) -> None:
        t0 = time.perf_counter()
        if "value.ready" not in self.events:  # colocated: first ready now the engine sleeps
            self.prepare_value()
        tokens = int(c["mask"].sum())  # counted on the host, before the chunk moves to the device
        c = to_device({k: v for k, v in c.items() if isinstance(v, torch.Tensor)}, self.device) | {
            k: v for k, v in c.items() if not isinstance(v, torch.Tensor)}
        ids, mask = c["input_ids"], c["mask"]
        k = len(self.chunks)
        with torch.no_grad():
            self.events.append("value.forward")
            old_values = self.value(ids, c.get("lengths")) * mask                 # (B_c, T), frozen (S6)
        # GAE needs only the values and rewards; the policy then runs micro-batch by micro-batch.
        adv, returns = compute_gae(c["rewards"], old_values, mask, self.cfg.gamma, self.cfg.lam)
        raw_adv = adv
        if self.cfg.normalize_advantages:
            adv = masked_whiten(adv, mask)                                       # per chunk (S19)
        self._policy_resident()
        entry = {**c, "old_values": old_values, "returns": returns, "adv": adv, "raw_adv": raw_adv, "tokens": tokens}
        old, refs, gaps = [], [], []
        for rows in self._micro_batches(ids.shape[0], self.cfg.policy_micro_rows):
            part = _slice_rows(entry, rows)
            if self.ref is not None and self.cfg.loss.get("kl_coef"):
                self.events.append("reference.forward")
                with torch.no_grad():
                    refs.append(token_logprobs(self.ref, part["input_ids"], lengths=part.get("lengths")))  # no graph yet
            self.events.append("policy.forward")
            with torch.set_grad_enabled(not self.cfg.critic_warmup):  # warmup: pi_old only, no backward follows
                logp, entropy = self._policy_forward(part)
            has_engine = "rollout_logp" in part
            old.append(part["rollout_logp"] if self.cfg.use_rollout_logprobs and has_engine else logp.detach())
            if has_engine:
                gaps.append(logprob_gap(logp.detach(), part["rollout_logp"], part["mask"]))
            if not self.cfg.critic_warmup:  # accumulates; no optimizer step between chunks (S5)
                part = {**part, "old_logp": old[-1], "ref_logp": refs[-1] if refs else None}
                self._policy_backward(logp, entropy, part)
                if gaps:
                    self.calls[-1]["ppo_logprob_gap"] = gaps[-1]
        if self.cfg.critic_warmup and gaps:
            self.calls.append({"ppo_logprob_gap": sum(gaps) / len(gaps)})
        # pi_old (the trainer's own at the step's starting weights, unless the engine's was asked
        # for) is frozen here for every policy epoch.
        self.chunks.append({**entry, "old_logp": torch.cat(old), "ref_logp": torch.cat(refs) if refs else None})
        self.log(f"train_pump: step {self.step} chunk {k} groups={c.get('groups', '?')} rows={ids.shape[0]} "
                 f"tokens={tokens}")
        self.prepare_value()  # before the caller waits for the next chunk (S12)
        self.last_chunk_s = time.perf_counter() - t0

    @staticmethod
    def _micro_batches(n: int, size: int) -> list[slice]:
        """Row slices of at most `size` rows (0 = all): every train rank holds the same rows per chunk
        (chunks are aligned), so every rank runs the same number of forward/backward calls."""
        size = size or n
        return [slice(i, i + size) for i in range(0, n, size)]

    # ---- close the step ----
    def close(self) -> dict:
        t0 = time.perf_counter()
        local = float(sum(c["tokens"] for c in self.chunks))
        if dist.all_reduce(torch.tensor([local], dtype=torch.float64)).item() == 0:  # every train rank agrees
            raise RuntimeError(f"train_pump: step {self.step}: every completion token is masked; "
                               "refusing both updates (S15)")
        out: dict = {}
        warm = self.cfg.critic_warmup
        if not warm:
            self._policy_resident()
            self.events.append("policy.step")
            out.update(self.policy_acc.finish())  # scale by the whole step's count, clip, one step (S8)
            for _ in range(1, self.cfg.ppo_epochs):  # full batch only: more epochs against the frozen pi_old
                if self.skipped:  # a non-finite loss abandoned the step's policy update: no more epochs
                    break
                for c in self.chunks:
                    for rows in self._micro_batches(c["input_ids"].shape[0], self.cfg.policy_micro_rows):
                        part = _slice_rows(c, rows)
                        logp, entropy = self._policy_forward(part)  # against the frozen pi_old and advantages
                        self._policy_backward(logp, entropy, part)
                self.events.append("policy.step")
                out.update(self.policy_acc.finish())
            if not self.cfg.refit_after_critic:
                self._refit()                     # before critic training (S9, S13)
            self.prepare_value()
        out.update(self._train_critic())
        if not warm and self.cfg.refit_after_critic:
            self._refit()                         # colocated full batch: generation stayed paused until now (S13)
        self.log(f"train_pump: step {self.step} closing on {len(self.chunks)} chunk(s)")
        if self.skipped:
            out["skipped_nonfinite"] = float(self.skipped)
        out.update(self._value_stats())
        return {**roll_up(self.calls), **out, "ppo_chunks": float(len(self.chunks)),
                "time/last_chunk": self.last_chunk_s, "time/close": time.perf_counter() - t0}

    def _value_stats(self) -> dict:
        """Over every train rank's valid tokens (a collective): the means of the raw advantages, returns and old
        values, and the critic's explained variance 1 - Var(R - V) / Var(R) (verl's vf_explained_var)."""
        sums = torch.zeros(7, dtype=torch.float64, device=self.device)
        for c in self.chunks:
            m = c["mask"].double()
            ret, val, adv = c["returns"].double(), c["old_values"].double(), c["raw_adv"].double()
            sums += torch.stack([m.sum(), (adv * m).sum(), (ret * m).sum(), (val * m).sum(), (ret.square() * m).sum(),
                                 ((ret - val) * m).sum(), ((ret - val).square() * m).sum()])
        total = dist.all_reduce(sums)
        adv, ret, val, ret2, err, err2 = (total[1:] / total[0].clamp_min(1)).cpu().tolist()  # one device sync
        var_ret, var_err = ret2 - ret * ret, err2 - err * err
        return {"advantages_mean": adv, "returns_mean": ret, "values_mean": val,
                "value_explained_var": 1 - var_err / var_ret if var_ret > 0 else float("nan")}

    @property
    def skipped(self) -> int:
        """Policy windows of this step abandoned for a non-finite loss or gradient."""
        return self.policy_acc.skipped - self._skipped_before

    def _policy_forward(self, part: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's logprobs and entropy on `part`'s rows, in every epoch alike; the entropy keeps its
        graph when it is a bonus (--ppo.entropy-coef)."""
        bonus = self.cfg.loss.get("entropy_coef")
        return token_logprobs(self.policy, part["input_ids"], entropy="grad" if bonus else True,
                              lengths=part.get("lengths"))

    def _policy_backward(self, logp: torch.Tensor, entropy: torch.Tensor | None, c: dict) -> None:
        loss, divisor, m = policy_loss(logp, c["old_logp"], c["adv"], c["mask"], ref_logp=c["ref_logp"],
                                       entropy=entropy, prefix="ppo", **self.cfg.loss)
        self.events.append("policy.backward")
        self.policy_acc.backward(loss, divisor)  # a non-finite loss poisons the step's window (B12)
        self.calls.append(m)

    def _refit(self) -> None:
        if self.refit is not None:
            self.events.append("refit")
            self.refit()

    def _train_critic(self) -> dict:
        """critic_ppo_epochs passes over the assembled batch against the frozen returns (S10)."""
        rows = [(c, i) for c in self.chunks for i in range(c["input_ids"].shape[0])]
        size = self.cfg.critic_micro_rows or len(rows)
        acc = Accumulator(self.value, self.value_opt, n_micro=None, max_grad_norm=self.cfg.value_max_grad_norm,
                          schedule=self.value_schedule)
        calls, samples, norms = [], 0, []
        for _ in range(self.cfg.critic_ppo_epochs):
            self.events.append("critic.epoch")
            for start in range(0, len(rows), size):
                part = rows[start:start + size]
                b = _stack(part, ("input_ids", "mask", "old_values", "returns", "lengths"))
                v = self.value(b["input_ids"], b.get("lengths"))
                loss, divisor, m = value_loss(v, b["old_values"], b["returns"], b["mask"], self.cfg.value_clip_eps)
                acc.backward(loss, divisor)
                calls.append(m)
                samples += len(part)
            norms.append(acc.finish().get("grad_norm", float("nan")))
        out = {**roll_up(calls), "value_epoch_n": samples / self.cfg.critic_ppo_epochs,
               "value_grad_norm": norms[-1]}
        if acc.skipped:
            out["value_skipped_nonfinite"] = float(acc.skipped)
        return out


def _slice_rows(c: dict, rows: slice) -> dict:
    """The rows `rows` of a chunk's per-row tensors (B_c, ...) and of its `lengths` list; other entries as they are."""
    return {k: v[rows] if isinstance(v, list) or isinstance(v, torch.Tensor) and v.dim() else v for k, v in c.items()}


def _stack(rows, keys) -> dict:
    """Rows from different chunks (each padded to its own length) -> one right-padded batch; `lengths`
    stays a host list."""
    T = max(c["input_ids"].shape[1] for c, _ in rows)
    out = {}
    for k in (k for k in keys if k in rows[0][0]):
        if isinstance(rows[0][0][k], list):
            out[k] = [c[k][i] for c, i in rows]
            continue
        out[k] = torch.stack([c[k][i] if c[k].dim() == 1 else torch.nn.functional.pad(c[k][i], (0, T - c[k].shape[1]))
                              for c, i in rows])
    return out
