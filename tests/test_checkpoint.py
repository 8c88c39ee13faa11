"""Checkpoints round-trip everything, survive truncation and corruption, and keep a good fallback."""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from helpers.ranks import run_ranks
from torch import nn

from mini_ddp.training.checkpoint import (
    LATEST,
    PREVIOUS,
    TrainState,
    load_checkpoint,
    save_checkpoint,
)


class Wrapper(nn.Module):
    """Stands in for DataParallelModel: the real model lives in ``.module``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # gives the optimizer momentum buffers worth saving
    return model, opt


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), float(np.random.rand()), random.random()


def test_round_trip_restores_model_optimizer_state_and_rng(tmp_path):
    model, opt = make(0)
    save_checkpoint(str(tmp_path), model, opt, TrainState(7, 2, 2, {"batch_in_epoch": 3}))
    expected_draws = draws()
    expected_params = params(model)
    expected_momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    other, other_opt = make(1)
    state = load_checkpoint(str(tmp_path), other, other_opt)
    assert state == TrainState(7, 2, 2, {"batch_in_epoch": 3})
    for a, b in zip(params(other), expected_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for p, m in zip(other.parameters(), expected_momentum, strict=True):
        torch.testing.assert_close(other_opt.state[p]["momentum_buffer"], m, rtol=0, atol=0)
    assert draws() == expected_draws  # torch, numpy and python RNGs continue where they were


def test_wrapped_model_is_saved_without_module_prefix(tmp_path):
    model, opt = make(0)
    save_checkpoint(str(tmp_path), Wrapper(model), opt, TrainState(1))
    plain, plain_opt = make(1)
    assert load_checkpoint(str(tmp_path), plain, plain_opt) is not None  # strict load: same keys
    for a, b in zip(params(plain), params(model), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_second_save_keeps_the_first_as_previous(tmp_path):
    model, opt = make(0)
    save_checkpoint(str(tmp_path), model, opt, TrainState(1))
    save_checkpoint(str(tmp_path), model, opt, TrainState(2))
    assert sorted(os.listdir(tmp_path)) == [LATEST, PREVIOUS]  # no temp files left behind
    assert load_checkpoint(str(tmp_path), model, opt).step == 2


def _two_checkpoints(tmp_path) -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
    """previous.pt at step 1 (holding the returned params), latest.pt at step 2 (different)."""
    model, opt = make(0)
    save_checkpoint(str(tmp_path), model, opt, TrainState(step=1))
    step1_params = params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_checkpoint(str(tmp_path), model, opt, TrainState(step=2))
    return model, opt, step1_params


def _assert_fell_back(tmp_path, caplog, step1_params):
    model, opt = make(3)
    with caplog.at_level(logging.WARNING, logger="mini_ddp.training.checkpoint"):
        state = load_checkpoint(str(tmp_path), model, opt)
    assert state is not None and state.step == 1
    for a, b in zip(params(model), step1_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(LATEST in r.getMessage() and "unusable" in r.getMessage() for r in caplog.records)


def test_truncated_latest_falls_back_to_previous(tmp_path, caplog):
    _, _, step1_params = _two_checkpoints(tmp_path)
    latest = tmp_path / LATEST
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # crash mid-copy
    _assert_fell_back(tmp_path, caplog, step1_params)


def test_empty_latest_falls_back_to_previous(tmp_path, caplog):
    _, _, step1_params = _two_checkpoints(tmp_path)
    (tmp_path / LATEST).write_bytes(b"")
    _assert_fell_back(tmp_path, caplog, step1_params)


def test_bit_flip_in_latest_is_caught_by_the_checksum(tmp_path, caplog):
    _, _, step1_params = _two_checkpoints(tmp_path)
    latest = tmp_path / LATEST
    blob = bytearray(latest.read_bytes())
    blob[len(blob) // 2] ^= 0x10  # inside tensor data: torch.load alone would not notice
    latest.write_bytes(bytes(blob))
    _assert_fell_back(tmp_path, caplog, step1_params)


def test_saving_over_a_damaged_latest_keeps_the_good_previous(tmp_path):
    model, opt, _ = _two_checkpoints(tmp_path)
    (tmp_path / LATEST).write_bytes(b"garbage")
    save_checkpoint(str(tmp_path), model, opt, TrainState(step=3))
    assert load_checkpoint(str(tmp_path), model, opt).step == 3
    (tmp_path / LATEST).write_bytes(b"garbage again")
    # previous.pt is still the step-1 file, not the garbage that was in latest.pt
    assert load_checkpoint(str(tmp_path), model, opt).step == 1


def test_nothing_usable_returns_none(tmp_path, caplog):
    model, opt = make(0)
    assert load_checkpoint(str(tmp_path / "missing"), model, opt) is None
    (tmp_path / LATEST).write_bytes(b"junk")
    (tmp_path / PREVIOUS).write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="mini_ddp.training.checkpoint"):
        assert load_checkpoint(str(tmp_path), model, opt) is None
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_a_leftover_temp_file_is_ignored(tmp_path):
    model, opt = make(0)
    save_checkpoint(str(tmp_path), model, opt, TrainState(step=5))
    (tmp_path / f".{LATEST}.tmp-12345").write_bytes(b"half a checkpoint from a crash")
    assert load_checkpoint(str(tmp_path), model, opt).step == 5


def _save_and_resume_on_two_ranks(ctx, ckpt_dir):
    model, opt = make(0)
    torch.manual_seed(100 + ctx.rank)  # different RNG streams per rank
    save_checkpoint(ckpt_dir, model, opt, TrainState(step=4))
    after_save = torch.rand(1).item()
    torch.manual_seed(999)
    state = load_checkpoint(ckpt_dir, model, opt)
    dist.barrier()
    return state.step, after_save, torch.rand(1).item(), sorted(os.listdir(ckpt_dir))


def test_two_ranks_one_writer_and_each_rank_gets_its_own_rng_back(tmp_path):
    results = run_ranks(_save_and_resume_on_two_ranks, 2, (str(tmp_path),), timeout_s=120)
    for step, after_save, after_load, files in results:
        assert step == 4 and after_load == after_save and files == [LATEST]
    assert results[0][1] != results[1][1]
