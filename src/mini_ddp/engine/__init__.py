"""The engine: everything between a parameter's gradient hook and its synchronised ``.grad``.

Read in this order: :mod:`.model` (the ``DistributedDataParallel`` stand-in, one class:
constructor checks, start-up broadcast, forward bookkeeping and the output sink, ``no_sync``,
comm-hook registration, ``Join``, pickling, torch DDP's underscore methods and its
compiled-autograd python reducer), :mod:`.reducer` (hooks, buckets counted down, launches in
order, the one wait), :mod:`.buckets` (DDP's bucket assignment and flat buffers), :mod:`.hooks` (the comm-hook
door: registration checks, built-in hooks, the Gloo wrapper ``gloo_safe``),
:mod:`.writeback` (results back into ``.grad``).
The reducer owns its state: :class:`~.reducer.StepState` (per-step counters, in
:mod:`.reducer`), :class:`~.buckets.BucketLayout` (bucket layout and rebuild, in
:mod:`.buckets`, with sparse buckets), :mod:`.unused` (unused parameters).
Off the main path:
:mod:`.join` (uneven inputs), :mod:`.comm` (start-up broadcast), :mod:`.torch_api`
(DDP's logging data, torch's reducer methods by name, refusals of torch's internals),
:mod:`.config`, :mod:`.multi_device`, :mod:`.delayed`, :mod:`.mixed_precision`.
Imports only :mod:`mini_ddp.transport` and :mod:`mini_ddp.errors`; what watches a sync lives in
:mod:`mini_ddp.watch`, what checks a user's mistakes in :mod:`mini_ddp.checks`.
"""
