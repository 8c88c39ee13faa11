"""explain(): its tables are the real bucket layouts (model.reducer.layout.buckets), with reasons."""

import contextlib
import io
import logging
import re

import pytest
import torch
from helpers.ranks import run_ranks
from torch import nn

from mini_ddp import DataParallelModel
from mini_ddp.engine.buckets import describe_layout
from mini_ddp.observe.explain import explain, layouts
from mini_ddp.tools.explain_cli import main
from mini_ddp.training.models import MixedDtypeMLP


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _tables(text):
    """Each table in an explain() text: {bucket: (dtype, bytes, [names])}."""
    tables, current, column, last = [], None, 0, None
    for line in text.splitlines():
        if line.strip().startswith("bucket  dtype"):
            current, column = {}, line.index("parameters")
            tables.append(current)
        elif current is not None and re.match(r"^\s+\d+\s{2}", line):
            index, dtype, _device, nbytes, count, names = re.split(r"\s{2,}", line.strip(), maxsplit=5)
            last = int(index)
            current[last] = (dtype, int(nbytes.replace(",", "")), int(count), names.rstrip(","))
        elif current is not None and line.startswith(" " * column) and line.strip():
            dtype, nbytes, count, names = current[last]  # a wrapped name list continues
            current[last] = (dtype, nbytes, count, f"{names}, {line.strip().rstrip(',')}")
        else:
            current = None
    for table in tables:
        for k, (dtype, nbytes, count, names) in table.items():
            table[k] = (dtype, nbytes, names.split(", "))
            assert count == len(table[k][2]), (count, names)
    return tables


def _actual(model):
    r = model.reducer
    return {b.index: (str(b.buffer.dtype).replace("torch.", ""), b.nbytes,
                      [r.names[i] for i in b.param_indices]) for b in r.layout.buckets}


def _cases(ctx):
    logs = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger("mini_ddp").addHandler(handler)
    logging.getLogger("mini_ddp").setLevel(logging.DEBUG)
    x = torch.randn(4, 16)
    out = {}

    torch.manual_seed(0)
    model = DataParallelModel(_net(), bucket_cap_mb=0.0005)
    before = explain(model)
    model(x).sum().backward()
    predicted = [v.buckets for v in layouts(model) if v.title.startswith("predicted")]
    model(x).sum().backward()
    out["default"] = (before, explain(model), _actual(model), predicted,
                      [list(b.param_indices) for b in model.reducer.layout.buckets], list(logs))

    mixed = DataParallelModel(MixedDtypeMLP())
    for _ in range(2):
        mixed(torch.randn(4, 64)).sum().backward()
    out["mixed"] = (explain(mixed), _actual(mixed))

    unused = DataParallelModel(_net(), bucket_cap_mb=0.0005, find_unused_parameters=True)
    for _ in range(2):
        unused(x).sum().backward()
    out["unused"] = (explain(unused), _actual(unused))

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        main(["--model", "mixed", "--steps", "2", "--bucket-cap-mb", "0.2"])
    out["cli"] = stdout.getvalue()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_cases, 2, timeout_s=120)


def test_explain_tables_match_the_real_buckets_before_and_after_the_rebuild(results):
    for out in results:
        before, after, actual, predicted, rebuilt, _ = out["default"]
        first = _tables(before)
        assert len(first) == 1 and list(first[0]) == [0]  # iteration 1: a single bucket
        assert first[0][0][2] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight",
                                  "4.bias"]  # definition order inside the bucket
        assert "rebuild: not yet" in before
        tables = _tables(after)
        assert tables[0] == first[0] and tables[1] == actual  # layout 1, then the current one
        assert len(actual) == 3 and actual[0][2] == ["4.bias", "4.weight"]
        assert predicted == [rebuilt]  # the prediction after step 1 is what step 2 built
        assert "layout 2 (current): rebuilt once" in after
        assert "closed when it reached its cap" in after
        assert results[0]["default"][2] == actual  # every rank has rank 0's layout


def test_the_log_line_is_the_same_table(results):
    _, after, actual, _, _, logs = results[0]["default"]
    layout_logs = [m for m in logs if "bucket layout" in m]
    assert len(layout_logs) == 2  # construction and rebuild
    assert "iteration 1: one bucket per dtype/device" in layout_logs[0]
    assert "rebuilt once" in layout_logs[1]
    assert _tables(layout_logs[1].split(":", 1)[1])[0] == actual
    assert _tables(after)[1] == actual


def test_float64_parameters_get_their_own_bucket_and_reason(results):
    text, actual = results[0]["mixed"]
    dtypes = {d for d, _, _ in actual.values()}
    assert dtypes == {"float32", "float64"}
    assert _tables(text)[-1] == actual
    assert "float64 on cpu is bucketed separately" in text
    assert "head.weight" in text and "float64 gradient to become ready" in text


def test_find_unused_parameters_keeps_the_first_layout(results):
    text, actual = results[0]["unused"]
    tables = _tables(text)
    assert len(tables) == 1 and tables[0] == actual and len(actual) > 1
    assert "never rebuilt" in text and "no rebuild" in text


def test_cli_prints_the_explanation(results):
    assert "layout 2 (current)" in results[0]["cli"]
    assert "float64" in results[0]["cli"]


def test_cli_cuts_and_wraps_long_name_lists(capsys):
    main(["--model", "lenet", "--steps", "1", "--max-names", "3", "--bucket-cap-mb", "0.01"])
    out = capsys.readouterr().out
    assert "0.weight, 0.bias, 3.weight, ... and 7 more" in out
    assert max(len(line) for line in out.splitlines() if "... and" in line) < 120
    assert "10 parameters, 242 KiB of gradients" in out.splitlines()[0]
    assert "cap 10.2 KiB (10,485 bytes)" in out and "0.0099" not in out


def test_cli_usage_error_for_an_unknown_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "lenett"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model 'lenett'" in err and "lenet" in err and "resnet18" in err


def test_describe_layout_cuts_long_name_lists():
    from types import SimpleNamespace

    row = SimpleNamespace(index=0, param_indices=list(range(9)), buffer=torch.zeros(1),
                          nbytes=36)
    text = describe_layout([row], [f"p{i}" for i in range(9)], max_names=3)
    assert "p0, p1, p2, … (+6)" in text and "p3" not in text
