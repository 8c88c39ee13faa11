"""Observing the engine without changing it: tracing, timelines and the bucket-layout
explanation. Imports the engine, never the reverse (the stall watch is :mod:`mini_ddp.watch`,
the desync check :mod:`mini_ddp.checks.replicas`).
"""
