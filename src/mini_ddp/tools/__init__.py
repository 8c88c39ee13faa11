"""Command-line tools (``python -m mini_ddp <command>``): demo, parity, explain, trace, bench,
cost model, collective bench. The top layer: it may import everything below, nothing imports it.
"""
