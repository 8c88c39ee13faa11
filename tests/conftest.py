"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from helpers.deadlines import hang_bound, slowdown


@pytest.fixture
def one_rank_group(tmp_path) -> Iterator[None]:
    """A one-rank Gloo group in this process (on a FileStore), destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


_MADE_HERE: list[str] = []  # the folders pytest_configure made (not the user's own)


def pytest_configure(config) -> None:
    """Flight recorder dumps (written on every stall, timeout or failed collective, by default
    into ./mini_ddp_flight) go to a temporary folder, inherited by every spawned rank."""
    import os
    import tempfile
    for name, prefix in (("MINI_DDP_FLIGHT_DIR", "mini_ddp_flight_"),
                         # One folder for tests/helpers/hang_scenarios.py's job, named here
                         # (in the controller, before any parallel worker starts) so that every
                         # worker inherits it and the job runs once.
                         ("MINI_DDP_HANGS_DIR", "mini_ddp_hangs_")):
        if name not in os.environ:
            os.environ[name] = tempfile.mkdtemp(prefix=prefix)
            _MADE_HERE.append(os.environ[name])
    # The machine's slowdown, measured once here for the same reason (tests/helpers/deadlines.py).
    slowdown()
    # Every rank of a test module imports that module, and with it pytest (0.15 s of CPU):
    # the server the ranks fork from imports it once (mini_ddp.training.spawn).
    from mini_ddp.training.spawn import forkserver_context
    forkserver_context(also_preload=("pytest", "helpers.ranks"))
    if os.environ.get("MINI_DDP_TEST_CPU_LOG"):  # CPU seconds per test (tests/helpers/cpu_account.py)
        from helpers.cpu_account import CpuAccount, MachineAccount
        log = os.environ["MINI_DDP_TEST_CPU_LOG"]
        config.pluginmanager.register(CpuAccount(log))
        if not hasattr(config, "workerinput"):  # the controller (or a run without workers)
            config.pluginmanager.register(MachineAccount(log))


def pytest_sessionfinish(session, exitstatus) -> None:
    """The folders made above are removed when the run passed; after a failure they stay, for
    the dumps and hang reports in them (the summary says where)."""
    import shutil
    if exitstatus == 0:  # a parallel worker made none (it inherits the controller's)
        for folder in _MADE_HERE:
            shutil.rmtree(folder, ignore_errors=True)


def pytest_report_header(config) -> str:
    return f"hang bounds scaled by {slowdown():.2f} (tests/helpers/deadlines.py)"


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(f"hang bounds were scaled by {slowdown():.2f} "
                                "(tests/helpers/deadlines.py)")
    stats = terminalreporter.stats
    if _MADE_HERE and (stats.get("failed") or stats.get("error")):
        terminalreporter.write_line("flight dumps and hang reports kept in: " +
                                    ", ".join(_MADE_HERE))


# The modules that take longest (``--durations``, summed per module), started first: under
# ``--dist loadscope`` a module runs on one worker, and a long one that starts last keeps that
# worker busy after the others are done. Only the order depends on this list.
LONG_FIRST = ("test_compile.py", "test_compile_features.py", "test_ladder.py", "test_examples.py",
              "test_integrations_lightning.py", "test_restart.py", "test_gpu_check.py",
              "test_attach.py", "test_doctor.py", "test_parity_cli.py",
              "test_example_minimal.py", "test_docs_comm_hooks.py", "test_two_hosts.py",
              "test_integrations_fabric.py", "test_bench.py", "test_demo.py",
              "test_comm_hooks.py", "test_mistakes.py", "test_docs_launching.py",
              "test_core_parity.py", "test_docs_errors.py", "test_zero_copy.py",
              "test_store_faults.py")


def pytest_collection_modifyitems(config, items) -> None:
    """Long modules first (``LONG_FIRST``); and pytest-timeout's limits bound hangs too: each
    test's (its mark's, else the run's ``--timeout`` or the ini's) is scaled by the session's
    slowdown."""
    first = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: same order
    default = config.getoption("timeout", None) or config.getini("timeout")
    for item in items:
        mark = item.get_closest_marker("timeout")
        kwargs = dict(mark.kwargs) if mark is not None else {}
        seconds = (mark.args[0] if mark is not None and mark.args else
                   kwargs.pop("timeout", None)) or default
        if seconds:
            item.add_marker(pytest.mark.timeout(hang_bound(float(seconds)), **kwargs),
                            append=False)
