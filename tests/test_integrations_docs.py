"""docs/integrations.md's code blocks, run as written: two ranks under torchrun, the names
each block leaves to the reader supplied (tests/helpers/docs_integrations_run.py).

Each block must train through ``DataParallelModel``, change the parameters, and leave both
ranks with the same ones. Bitwise parity with torch DDP under each framework is the business
of the other tests/test_integrations_*.py files.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.torchrun_json import framework_run

for _framework in ("lightning", "accelerate", "transformers"):  # Fabric ships with lightning
    pytest.importorskip(_framework)



@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return framework_run(request, "docs_integrations_run")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", ["lightning", "fabric", "accelerate", "transformers"])
def test_documented_lines_train_with_mini_ddp(results: list[dict[str, Any]],
                                              framework: str) -> None:
    for r in results:
        got = r[framework]
        expected = {"wrapped_by": "DataParallelModel", "changed": True, "ranks agree": True}
        if framework == "fabric":
            expected["saved"] = True  # the block's fabric.save wrote its file on rank 0
        assert got == expected, got
