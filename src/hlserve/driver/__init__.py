"""The driving layer: one closed-loop agent driver and one request record, summary and tax
(shared by the offline benchmarks, the in-process sweep, the HTTP benchmark and the study),
the workloads they drive (agent sessions, Mooncake traces, chat, the coding pipeline) and the
tool-call pauses between rounds, repeats with intervals, and points spread over a Ray cluster."""
