"""The simulated runner: the real scheduler on a virtual clock with a cost model of a GPU
(`sim/sim_runner.py`), its hardware profiles and model shapes, and an engine built on it
(`sim/build.py`). What measures with it (calibration, the study) is in `hlserve.study`."""
