"""Watch torch.compile's DDPOptimizer split graphs at DDP's bucket boundaries."""

from __future__ import annotations


def spy_on_ddp_optimizer() -> list[tuple[int, int]]:
    """Record (bucket_bytes_cap, number of subgraphs) of every graph DDPOptimizer splits."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    calls: list[tuple[int, int]] = []
    original = DDPOptimizer.compile_fn

    def compile_fn(self, gm, example_inputs, **kwargs):
        compiled = original(self, gm, example_inputs, **kwargs)
        calls.append((self.bucket_bytes_cap, len(self.buckets)))
        return compiled

    DDPOptimizer.compile_fn = compile_fn
    return calls
