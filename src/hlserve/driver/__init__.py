"""The driving layer: one closed-loop agent driver and one request record, summary and tax
(shared by the offline benchmarks, the in-process sweep, the HTTP benchmark and the study),
repeats with intervals, and points spread over a Ray cluster."""
