"""Transports: how bytes are summed between ranks and devices, knowing nothing of DDP.

:mod:`.shm` (shared-memory all-reduce for the ranks of one host; its parts :mod:`.shm_files`,
:mod:`.shm_slots`, :mod:`.shm_sum`, :mod:`.shm_sync`), :mod:`.local_comm`
(``torch.cuda.comm``'s intra-process collectives, also on CPU) and :mod:`.collectives`
(teaching all-reduce algorithms built from sends and receives). Imports only
:mod:`mini_ddp.errors`.
"""
