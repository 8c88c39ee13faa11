"""The benchmark runs end to end and reports every engine; memory accounting adds up.

Nothing here asserts a time: timings on a shared 2-core machine are noise at this size.
"""

from __future__ import annotations

import json

import pytest
import torch

from mini_ddp.tools import bench
from mini_ddp.tools.bench_models import ENGINES, MANY_SMALL, build_engine, tensor_bytes
from mini_ddp.training.models import ZOO


@pytest.mark.timeout(300)
def test_bench_end_to_end_tiny_model_emits_json_with_all_engines(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "sweep.png"
    rc = bench.main(["--models", "tiny", "--quick", "--engines", ",".join(ENGINES),
                     "--sweep-model", "tiny", "--mem-steps", "1", "--timeout", "240",
                     "--json", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    (row,) = report["results"]
    assert (row["model"], row["world_size"]) == ("tiny", 2)
    for key in ("median_ms", "cpu_ms", "over_ddp", "over_compute", "exposed_comm_ms"):
        assert set(row[key]) == set(ENGINES), key
    assert all(v > 0 for v in row["median_ms"].values())
    assert row["over_ddp"]["torch_ddp"] == 1.0 and row["over_compute"]["compute"] == 1.0
    assert all(len(v) == 3 for v in row["blocks_ms"].values())  # --quick: 3 blocks
    assert set(row["memory"]) == set(ENGINES) | {"torch_ddp+gabv", "mini_ddp+gabv"}
    assert [r["bucket_cap_mb"] for r in report["sweep"]] == [1.0, 25.0]
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "mini_ddp" in printed and "bucket-cap sweep" in printed


def test_tensor_bytes_counts_params_grads_and_buckets_once():
    # No process group needed for the plain engines; the DDP ones are covered end to end.
    base = ZOO["tiny"].builder()
    engine = build_engine("compute", base, None, False)
    params = sum(p.numel() * 4 for p in base.parameters())
    assert tensor_bytes(engine) == params  # no grads yet
    x, y = ZOO["tiny"].make_batch(4, torch.Generator().manual_seed(0))
    engine.step((x, y))
    assert tensor_bytes(engine) == 2 * params  # + one gradient per parameter


def test_summarize_pairs_blocks_and_takes_the_slowest_rank():
    per_rank = [{"torch_ddp": {"wall": [1.0, 2.0, 4.0], "cpu": [1.0, 1.0, 1.0]},
                 "mini_ddp": {"wall": [0.5, 2.0, 5.0], "cpu": [0.5, 1.0, 1.0]},
                 "compute": {"wall": [0.5, 1.0, 2.0], "cpu": [0.5, 1.0, 1.0]}},
                {"torch_ddp": {"wall": [1.0, 3.0, 4.0], "cpu": [1.0, 1.0, 1.0]},
                 "mini_ddp": {"wall": [0.9, 2.0, 4.0], "cpu": [0.5, 1.0, 1.0]},
                 "compute": {"wall": [0.5, 1.0, 2.0], "cpu": [0.5, 1.0, 1.0]}}]
    s = bench.summarize(per_rank)
    # slowest rank per block: ddp [1, 3, 4], mini [0.9, 2, 5] -> ratios 0.9, 0.667, 1.25
    assert s["over_ddp"]["mini_ddp"] == pytest.approx(0.9)
    assert s["median_ms"]["torch_ddp"] == pytest.approx(3000.0)
    assert s["exposed_comm_ms"]["mini_ddp"] == pytest.approx(2000.0 - 1000.0)
    assert s["over_compute"]["compute"] == 1.0


@pytest.mark.timeout(300)
def test_many_small_regime_reports_per_gradient_cost_and_start_up(tmp_path):
    # The preset with tiny rounds: both many-small models, both DDPs and compute alone, the
    # start-up rounds; world size 2 only, to stay short. Fields, never times, are checked.
    out = tmp_path / "many_small.json"
    rc = bench.main(["--many-small", "--world-sizes", "2", "--steps", "1", "--blocks", "2",
                     "--warmup", "1", "--startup-rounds", "1", "--timeout", "240",
                     "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["model"] for r in report["results"]] == list(MANY_SMALL)
    assert report["sweep"] == [] and all("memory" not in r for r in report["results"])
    engines = {"torch_ddp", "mini_ddp", "compute"}
    for row in report["results"]:
        assert row["num_grads"] == sum(
            p.requires_grad for p in ZOO[row["model"]].builder().parameters()) > 150
        assert set(row["per_grad_us"]) == engines and row["per_grad_us"]["compute"] == 0.0
        exposed = row["exposed_comm_ms"]["mini_ddp"]
        assert row["per_grad_us"]["mini_ddp"] == pytest.approx(exposed * 1e3 / row["num_grads"])
        startup = row["startup"]
        for key in ("construct_ms", "first_step_ms", "second_step_ms"):
            assert set(startup[key]) == engines and all(v > 0 for v in startup[key].values())
        assert startup["over_ddp"]["construct"]["torch_ddp"] == 1.0
    first, later = report["results"]  # each DDP's first wrap is timed in the first job only
    assert set(first["first_wrap_ms"]) == {"torch_ddp", "mini_ddp"}
    assert all(v > 0 for v in first["first_wrap_ms"].values()) and "first_wrap_ms" not in later
    text = bench.format_report(report)
    assert "per gradient" in text and "start-up" in text and "first wrap" in text


def test_summarize_startup_takes_the_slowest_rank_and_pairs_rounds():
    per_rank = [{"torch_ddp": {"construct": [1.0, 2.0], "first_step": [1.0, 1.0]},
                 "mini_ddp": {"construct": [2.0, 2.0], "first_step": [0.5, 3.0]}},
                {"torch_ddp": {"construct": [2.0, 1.0], "first_step": [1.0, 1.0]},
                 "mini_ddp": {"construct": [1.0, 1.0], "first_step": [1.0, 1.0]}}]
    s = bench.summarize_startup(per_rank)
    # slowest rank per round: ddp construct [2, 2], mini [2, 2]; mini first step [1, 3]
    assert s["construct_ms"]["mini_ddp"] == pytest.approx(2000.0)
    assert s["over_ddp"]["construct"]["mini_ddp"] == pytest.approx(1.0)
    assert s["over_ddp"]["first_step"]["mini_ddp"] == pytest.approx(2.0)
    assert s["over_ddp_range"]["first_step"]["mini_ddp"] == pytest.approx((1.0, 3.0))


def test_summarize_per_gradient_cost_is_exposed_time_over_gradients():
    per_rank = [{"torch_ddp": {"wall": [0.012], "cpu": [0.01]},
                 "mini_ddp": {"wall": [0.011], "cpu": [0.01]},
                 "compute": {"wall": [0.010], "cpu": [0.01]}}]
    s = bench.summarize(per_rank, num_grads=200)
    assert s["per_grad_us"]["torch_ddp"] == pytest.approx(2e3 / 200)
    assert s["per_grad_us"]["mini_ddp"] == pytest.approx(1e3 / 200)
    assert "per_grad_us" not in bench.summarize(per_rank)  # no gradient count given
