"""Observing the engine without changing it: tracing, timelines, the stall watchdog, the
desync check and the bucket-layout explanation. Imports the engine, never the reverse.
"""
