"""The engine: everything between a parameter's gradient hook and its synchronised ``.grad``.

Read in this order: :mod:`.model` (the ``DistributedDataParallel`` stand-in: start-up
broadcast, forward bookkeeping, ``no_sync``; its other faces are the mixins
:mod:`.comm_hook_registration`, :mod:`.ddp_private_api` and :mod:`.joinable`, its outputs pass
:mod:`.output_sink`), :mod:`.reducer` (hooks, buckets counted down, launches in order, the one
wait; torch's reducer methods by name in :mod:`.torch_reducer_api`), :mod:`.buckets` (DDP's bucket assignment and flat buffers), :mod:`.hooks` (the comm-hook
door; registration checks in :mod:`.hook_checks`, the Gloo wrapper in :mod:`.gloo_safe`),
:mod:`.writeback` (results back into ``.grad``).
The reducer's state: :mod:`.reducer_state` (its base class), :mod:`.step_state`,
:mod:`.graph_state` (bucket layout and rebuild), :mod:`.unused` (unused parameters); its steps
:mod:`.copy_in` and :mod:`.bucket_wait`, and DDP's variants of them in :mod:`.grad_routing`.
Off the main path:
:mod:`.join` (uneven inputs), :mod:`.comm` (start-up broadcast), :mod:`.construction`
(constructor checks), :mod:`.config`, :mod:`.multi_device`. Imports only
:mod:`mini_ddp.transport` and :mod:`mini_ddp.errors`.
"""
