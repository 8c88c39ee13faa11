"""The collective benchmark runs end to end on tiny sizes and writes sane JSON and a PNG.

No timing is asserted (the machine is shared and noisy): only that every number exists, is
finite and positive, and that the derived columns follow nccl-tests' definitions.
"""

from __future__ import annotations

import json
import math

import pytest

from mini_ddp.tools.collective_bench import ALGORITHMS, main, parse_bytes
from mini_ddp.transport.collectives.cost import cost_terms, fit_alpha_beta, predict


def test_end_to_end_tiny(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "img" / "busbw.png"
    status = main(["--world-size", "2", "--min-bytes", "1K", "--max-bytes", "4K",
                   "--factor", "2", "--iters", "2", "--json", str(out_json),
                   "--plot", str(out_png)])
    assert status == 0
    report = json.loads(out_json.read_text())
    assert report["world_size"] == 2 and report["sizes"] == [1024, 2048, 4096]
    assert set(report["algorithms"]) == set(ALGORITHMS)
    assert set(report["fits"]) == set(ALGORITHMS)
    rows = report["results"]
    assert {(r["algorithm"], r["bytes"]) for r in rows} == {
        (a, s) for a in ALGORITHMS for s in (1024, 2048, 4096)}
    for r in rows:
        for key in ("time_us", "algbw_GBps", "busbw_GBps", "model_us"):
            assert math.isfinite(r[key]) and r[key] > 0, (r, key)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
    for fit in report["fits"].values():
        assert fit["alpha_us"] >= 0 and fit["beta_ns_per_byte"] >= 0
        assert fit["alpha_us"] + fit["beta_ns_per_byte"] > 0
    assert out_png.exists() and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "busbw(GB/s)" in printed and "halving_doubling" in printed
    # --replot re-reads saved reports (no ranks) and plots them side by side.
    replot = tmp_path / "two.png"
    assert main(["--replot", str(out_json), str(out_json), "--plot", str(replot)]) == 0
    assert replot.exists() and capsys.readouterr().out.count("busbw(GB/s)") == 2


def test_parse_bytes():
    assert parse_bytes("1K") == 1024
    assert parse_bytes("4KiB") == 4096
    assert parse_bytes("64M") == 64 << 20
    assert parse_bytes("300") == 300


def test_cost_formulas():
    # Textbook values: the ring sends 2(n-1)/n of the data in 2(n-1) steps.
    ring = cost_terms("ring", 4, 1000)
    assert (ring.alpha_count, ring.beta_bytes, ring.gamma_bytes) == (6, 1500, 750)
    hd = cost_terms("halving_doubling", 4, 1000)  # power of two: 2 log2 4 steps, no fold
    assert (hd.alpha_count, hd.beta_bytes) == (4, 1500)
    hd5 = cost_terms("halving_doubling", 5, 1000)  # 5 = 4 + 1: fold in and out
    assert (hd5.alpha_count, hd5.beta_bytes) == (6, 3500)
    assert cost_terms("tree", 5, 1000).alpha_count == 6  # ceil(log2 5) = 3 rounds, twice
    assert cost_terms("naive", 3, 1000).beta_bytes == 4000
    assert cost_terms("ring", 1, 1000).alpha_count == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_fit_recovers_known_parameters(algorithm):
    sizes = [4**k * 1024 for k in range(8)]
    times = [predict(algorithm, 3, m, 50e-6, 2e-9) for m in sizes]
    fit = fit_alpha_beta(algorithm, 3, sizes, times)
    assert fit.alpha == pytest.approx(50e-6) and fit.beta == pytest.approx(2e-9)
    assert fit.rms_rel_error < 1e-9


def test_fit_never_goes_negative():
    # Times that *fall* with size would need a negative beta: clamp it to zero instead.
    fit = fit_alpha_beta("ring", 2, [1024, 4096, 16384], [3e-3, 2e-3, 1e-3])
    assert fit.alpha > 0 and fit.beta == 0
