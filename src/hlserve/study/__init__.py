"""Measurement over the simulator: the cost model's calibration against real runs (``calibrate``,
``hlserve calibrate``), the drivers of simulated runs (``drive``: steady-state closed loop,
open-loop arrivals), and the human-tax study (``hlserve study``): sweep the SLO knobs of each
system over context length and concurrency on a simulated machine, and trace the
throughput-versus-SLO frontier.

A point is (system, C or B, context, sessions). Systems are the presets (``sglang`` sweeps
its chunk size C; ``sarathi`` its C = B; ``vllm`` its token budget B), throughput mode
(``hlserve``), throughput mode with one component turned off at a time (the ablations), and
the other engines' own schedulers, stock and with hlserve's plugin (``vllm-0.34``,
``sglang-0.5.23``, ...: ``foreign``), run in their environments on the same runner.
Each point runs the closed-loop agent workload at constant concurrency (``run_agent_steady``)
on an Engine with the real Scheduler and KV cache and a SimRunner, and writes one JSON file.

Human tax at an SLO target (TTFT p99 <= x, TPOT p99 <= y), per context and concurrency:
``1 - best throughput among points meeting it / best throughput of all points``.

The study's modules, each importing only those before it: ``foreign`` (the other engines'
schedulers as systems: their environments, and a point run as a child process), ``core`` (systems, SLOs,
``StudySpec``, ``StudyPoint``, ``run_point``, the SLO check, tax, frontier and components),
``runs`` (running the points, resumably, on seeds, locally or on Ray; loading them), ``seeds``
(the study over seeds, with intervals), ``model_error`` (the cost model perturbed by the
fidelity suite's residuals; the headline numbers over seeds and model error together),
``plots`` (the figures), ``study_report`` (figures, tables and summaries from the stored
points).
"""
