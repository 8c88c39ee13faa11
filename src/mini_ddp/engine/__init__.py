"""The engine: everything between a parameter's gradient hook and its synchronised ``.grad``.

Read in this order: :mod:`.model` (the ``DistributedDataParallel`` stand-in: start-up
broadcast, forward bookkeeping, ``no_sync``; its other faces are the mixins
:mod:`.comm_hook_registration`, :mod:`.ddp_private_api` and :mod:`.joinable`, its outputs pass
:mod:`.output_sink`), :mod:`.reducer` (hooks, buckets counted down, launches in order, the one
wait; torch's reducer methods by name in :mod:`.torch_reducer_api`), :mod:`.buckets` (DDP's bucket assignment and flat buffers), :mod:`.hooks` (the comm-hook
door: registration checks, built-in hooks, the Gloo wrapper ``gloo_safe``),
:mod:`.writeback` (results back into ``.grad``).
The reducer owns its state: :class:`~.reducer.StepState` (per-step counters, in
:mod:`.reducer`), :class:`~.buckets.BucketLayout` (bucket layout and rebuild, in
:mod:`.buckets`, with sparse buckets), :mod:`.unused` (unused parameters).
Off the main path:
:mod:`.join` (uneven inputs), :mod:`.comm` (start-up broadcast), :mod:`.construction`
(constructor checks), :mod:`.config`, :mod:`.multi_device`, :mod:`.stall` (the stall warning, stack responder and flight
recorder), :mod:`.delayed`, :mod:`.mixed_precision`. Imports only
:mod:`mini_ddp.transport` and :mod:`mini_ddp.errors`.
"""
