"""The engine: everything between a parameter's gradient hook and its synchronised ``.grad``.

Read in this order: :mod:`.model` (the ``DistributedDataParallel`` stand-in: constructor checks,
start-up broadcast, forward bookkeeping, ``no_sync``), :mod:`.reducer` (hooks, buckets counted
down, launches in order, the one wait), :mod:`.buckets` (DDP's bucket assignment and flat
buffers), :mod:`.hooks` (the comm-hook door), :mod:`.writeback` (results back into ``.grad``).
The reducer's state: :mod:`.step_state`, :mod:`.graph_state` (bucket layout and rebuild),
:mod:`.unused` (unused parameters); its steps :mod:`.copy_in` and :mod:`.bucket_wait`.
Off the main path:
:mod:`.join` (uneven inputs), :mod:`.comm` (start-up broadcast), :mod:`.config`,
:mod:`.multi_device`. Imports only :mod:`mini_ddp.transport` and :mod:`mini_ddp.errors`.
"""
