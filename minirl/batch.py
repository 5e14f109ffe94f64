"""The rank-local rollout store and the dispatch that turns a chunk index into tensors.

spec/batching.md "The core idea": the driver loop passes indices only (B3). `pack` turns this
rank's samples into right-padded tensors once per collected batch; `chunk(batch, start, size)`
returns rows [start, start + size) of it, trimmed to that chunk's own longest sequence, so a
micro-batch of short completions costs short activations. The trainer then sees a plain batch.

Shapes: B_r rows on this rank, T = longest prompt + completion in the batch.
Row layout: [prompt tokens | completion tokens | pad]; `mask` is 1.0 on completion tokens.
"""

from __future__ import annotations

import torch

from minirl.rollout import Samples


def pack(samples: Samples, advantages: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Samples -> {input_ids (B_r, T) long, mask (B_r, T), rollout_logp (B_r, T), advantages (B_r,), lengths (B_r,)}."""
    rows = [p + c for p, c in zip(samples.prompt_tokens, samples.completion_tokens)]
    B, T = len(rows), max(map(len, rows))
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    rollout_logp = torch.zeros(B, T)
    for i, (p, c, lp) in enumerate(zip(samples.prompt_tokens, samples.completion_tokens, samples.logprobs)):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c)
        mask[i, len(p):n] = 1.0
        rollout_logp[i, len(p):n] = torch.tensor(lp, dtype=torch.float32)
    return {"input_ids": input_ids, "mask": mask, "rollout_logp": rollout_logp,
            "advantages": advantages.float(), "lengths": torch.tensor([len(r) for r in rows])}


def chunk(batch: dict[str, torch.Tensor], start: int, size: int) -> dict[str, torch.Tensor]:
    """Rows [start, start+size) of this rank's batch, columns trimmed to the chunk's longest row."""
    rows = slice(start, start + size)
    T = int(batch["lengths"][rows].max())
    return {k: (v[rows, :T] if v.dim() == 2 else v[rows]) for k, v in batch.items()}
