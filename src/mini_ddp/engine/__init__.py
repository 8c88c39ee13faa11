"""The engine: everything between a parameter's gradient hook and its synchronised ``.grad``.

Read in this order: :mod:`.model` (the ``DistributedDataParallel`` stand-in, one class:
constructor checks, start-up broadcast, forward bookkeeping and the output sink, ``no_sync``,
comm-hook registration, ``Join``, pickling, torch DDP's underscore methods and its
compiled-autograd python reducer), :mod:`.reducer` (hooks, buckets counted down, launches in
order, the one wait), :mod:`.buckets` (DDP's bucket assignment and flat buffers), :mod:`.hooks` (the comm-hook
door; registration checks in :mod:`.hook_checks`, the Gloo wrapper in :mod:`.gloo_safe`),
:mod:`.writeback` (results back into ``.grad``).
The reducer's state: :mod:`.reducer_state` (its base class), :mod:`.step_state`,
:mod:`.graph_state` (bucket layout and rebuild), :mod:`.unused` (unused parameters); its steps
:mod:`.copy_in` and :mod:`.bucket_wait`, and DDP's variants of them in :mod:`.grad_routing`.
Off the main path:
:mod:`.join` (uneven inputs), :mod:`.comm` (start-up broadcast), :mod:`.torch_api`
(DDP's logging data, torch's reducer methods by name, refusals of torch's internals),
:mod:`.config`, :mod:`.multi_device`. Imports only
:mod:`mini_ddp.transport` and :mod:`mini_ddp.errors`.
"""
