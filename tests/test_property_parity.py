"""Property: on random small MLPs, DataParallelModel trains bit for bit like torch DDP.

Hypothesis draws, in the parent process, a batch of configurations (layer widths, a float32 /
float64 dtype per layer, bucket cap, world size 1-3, batch size, seed). The batch is split by
world size and each part is checked by ONE ``run_ranks`` call, so an example costs a couple of
process start-ups however many configurations it holds. In each rank torch DDP and
DataParallelModel train deep copies of the same model (each rank starts from a different random
model, so the start-up broadcast is exercised) on the same per-rank data for several steps; every
gradient and every parameter is compared with ``torch.equal`` after every step. Steps >= 2 run
after the bucket rebuild, so both layouts are covered.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from helpers.deadlines import hang_bound
from helpers.ranks import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mini_ddp import DataParallelModel

STEPS = 3


@dataclass(frozen=True)
class Config:
    """One random case; plain data so it pickles into the ranks and prints when shrunk."""

    widths: tuple[int, ...]
    dtypes: tuple[str, ...]  # one per layer
    bucket_cap_mb: float | None
    world_size: int
    batch: int
    seed: int


@st.composite
def configs(draw: st.DrawFn) -> Config:
    widths = tuple(draw(st.lists(st.integers(1, 24), min_size=2, max_size=5)))
    layers = len(widths) - 1
    dtypes = tuple(draw(st.lists(st.sampled_from(["float32", "float64"]),
                                 min_size=layers, max_size=layers)))
    # From "every parameter its own bucket" to "one bucket", and DDP's defaults (None).
    cap = draw(st.sampled_from([None, 0.00001, 0.0005, 0.002, 1.0]))
    return Config(widths, dtypes, cap, draw(st.integers(1, 3)), draw(st.integers(1, 6)),
                  draw(st.integers(0, 2**16)))


class _MixedMLP(nn.Module):
    def __init__(self, widths: tuple[int, ...], dtypes: tuple[str, ...]):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, dtype=getattr(torch, d))
            for a, b, d in zip(widths, widths[1:], dtypes, strict=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x.to(layer.weight.dtype))
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def _first_difference(cfg: Config, rank: int) -> str | None:
    """Train both engines on ``cfg``; describe the first bit that differs, or None."""
    torch.manual_seed(cfg.seed * 7 + rank)  # a different starting model on every rank
    base = _MixedMLP(cfg.widths, cfg.dtypes)
    engines = {"torch": DDP(copy.deepcopy(base), bucket_cap_mb=cfg.bucket_cap_mb),
               "mini": DataParallelModel(copy.deepcopy(base), bucket_cap_mb=cfg.bucket_cap_mb)}
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
              for k, m in engines.items()}
    data = torch.Generator().manual_seed(cfg.seed * 1000 + rank)  # per-rank data
    for step in range(STEPS):
        x = torch.randn(cfg.batch, cfg.widths[0], generator=data)
        target = torch.randn(cfg.batch, cfg.widths[-1], generator=data)
        for name, model in engines.items():
            optims[name].zero_grad(set_to_none=True)
            loss = (model(x).double() - target.double()).square().mean()
            loss.backward()
        pairs = zip(engines["torch"].module.named_parameters(),
                    engines["mini"].module.parameters(), strict=True)
        for (pname, theirs), ours in pairs:
            if not torch.equal(theirs.grad, ours.grad):
                diff = (theirs.grad - ours.grad).abs().max().item()
                return f"step {step}: grad of {pname} differs (max |diff| {diff:.3g})"
        for opt in optims.values():
            opt.step()
        pairs = zip(engines["torch"].module.named_parameters(),
                    engines["mini"].module.parameters(), strict=True)
        for (pname, theirs), ours in pairs:
            if not torch.equal(theirs, ours):
                return f"step {step}: parameter {pname} differs after the optimizer step"
    return None


def _check(ctx, cases: list[dict]) -> list[str | None]:
    return [_first_difference(Config(**case), ctx.rank) for case in cases]


@settings(max_examples=4, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(configs(), min_size=3, max_size=8))
def test_parity_with_torch_ddp_holds_on_random_mlps(batch: list[Config]) -> None:
    for world_size in sorted({c.world_size for c in batch}):
        cases = [c for c in batch if c.world_size == world_size]
        per_rank = run_ranks(_check, world_size, args=([asdict(c) for c in cases],),
                             timeout_s=240, collective_timeout_s=hang_bound(120))
        for rank, verdicts in enumerate(per_rank):
            for case, verdict in zip(cases, verdicts, strict=True):
                assert verdict is None, f"rank {rank}, {case}: {verdict}"
