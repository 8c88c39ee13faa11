"""torch's C++ reducer's Python methods, by name, on mini_ddp's reducer.

Frameworks reach past DDP into ``model.reducer``: PyTorch Lightning arms a backward that runs
inside the forward (manual optimization) with ``reducer._rebuild_buckets()`` and
``reducer.prepare_for_backward(outputs)``, and reduces a static graph's first iteration there
with ``reducer._delay_all_reduce()``; Accelerate's ``trigger_sync_in_backward`` calls
``reducer.prepare_for_backward([])``. :class:`TorchReducerAPI` gives
:class:`~mini_ddp.engine.reducer.Reducer` every method torch's ``torch._C._distributed_c10d.Reducer``
exposes: each does what torch's does over mini_ddp's state, or — for internals no framework
calls and mini_ddp organises differently — refuses with ``NotImplementedError`` naming the
alternative. A backward nobody armed is never left silently local
(:class:`~mini_ddp.engine.reducer.UnarmedBackwardError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from mini_ddp.engine.hooks import GradBucket, allreduce_sum_hook, launch_hook
from mini_ddp.engine.logging_data import RuntimeLog


class TorchReducerAPI:
    """torch's reducer methods (a mixin of :class:`~mini_ddp.engine.reducer.Reducer`: it uses
    the reducer's buckets, step state, hooks and unused-parameter search)."""

    runtime_log: RuntimeLog | None = None  # the model's logging data (set by the model)

    def _rebuild_buckets(self) -> bool:
        """Check the last backward finished; rebuild buckets once (True if it did now)."""
        return self.rebuild_buckets_if_needed()

    def _delay_all_reduce(self) -> None:
        """Reduce a static graph's first iteration now (after its backward has run)."""
        self.delay_all_reduce()

    def _autograd_hook(self, index: int) -> None:
        """Run parameter ``index``'s gradient hook by hand."""
        self.autograd_hook(index)

    def _check_reducer_finalized(self) -> None:
        """Raise if the last backward left gradients unreduced, naming them."""
        self.ensure_prior_reduction_finished()

    def _remove_autograd_hooks(self) -> None:
        """Remove every gradient hook."""
        self.remove_autograd_hooks()

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Sample runtime statistics every ``sample_rate`` iterations after the first ten."""
        self.runtime_log.set_sample_rate(sample_rate)

    def _push_all_rebuilt_params(self) -> None:
        """Rebuild with every parameter if this rank recorded no order (a joined rank)."""
        self.layout.record_all()

    def _get_zeros_like_grad_buckets(self) -> list[GradBucket]:
        """Every bucket as a hook sees it, holding zeros (what a joined rank reduces)."""
        return [GradBucket.of(b, len(self.layout.buckets), torch.zeros_like(b.buffer))
                for b in self.layout.buckets]

    def _run_comm_hook(self, bucket: GradBucket) -> torch.futures.Future:
        """Launch ``bucket``'s collective through the registered hook (or the default)."""
        return launch_hook(self.comm_hook, self.comm_hook_state, self.group, bucket)

    def _run_allreduce_hook(self, bucket: GradBucket) -> torch.futures.Future:
        """Launch ``bucket``'s default all-reduce (a sum: gradients are pre-divided)."""
        return allreduce_sum_hook(self.group, bucket)

    def _get_local_used_map(self) -> torch.Tensor:
        """Which parameters this rank's backward used (1) since the map was last reset."""
        return self.unused_search.local_used


def _refusal(name: str, instead: str) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"mini_ddp: Reducer.{name} is internal to torch's C++ "
                                  f"reducer; {instead}")
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Refused (``NotImplementedError``): {instead}"
    return refuse


# torch's reducer methods only torch DDP's own constructor and features call.
TORCH_REDUCER_INTERNALS: dict[str, str] = {
    "get_backward_stats": "per-parameter timings are not recorded; the logging data has the "
                          "backward's compute and communication times.",
    "_ddp_graph_static": "whether the graph stayed static is not tracked; pass "
                         "static_graph=True when it is.",
    "_install_post_backward_futures": "buffer communication hooks are not supported.",
    "_set_forward_pass_work_handle": "Join is wired in by DataParallelModel.forward.",
    "_set_static_graph": "call DataParallelModel._set_static_graph() (it rebuilds the reducer).",
    "set_logger": "the logging data is DataParallelModel._get_ddp_logging_data().",
    "_set_sparse_metadata": "sparse gradients are reduced as whole tensors.",
    "_reset_state": "build a new DataParallelModel instead.",
    "_update_process_group": "build a new DataParallelModel on the new process group.",
    "_set_mixed_precision_param_dtype": "pass mixed_precision= to DataParallelModel.",
    "_set_optimizer_in_backward": "optimizers applied in backward are not supported.",
}
for _name, _instead in TORCH_REDUCER_INTERNALS.items():
    setattr(TorchReducerAPI, _name, _refusal(_name, _instead))


def outputs_list(outputs: Any) -> Sequence[torch.Tensor]:
    """``prepare_for_backward``'s argument as torch's binding takes it: a tensor or a list."""
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
