"""The simulator: the real scheduler on a virtual clock with a cost model of a GPU
(`sim/runner.py`), its calibration, and `hlserve cost / calibrate / study`."""
