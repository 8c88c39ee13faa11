"""Training around the engine: the example loop, data, checkpoints, launching ranks
(torchrun, ``mp.spawn``, the test harness) and the model zoo.
"""
