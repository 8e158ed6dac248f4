"""The driving layer: runs workloads on engines and servers, repeats them, and spreads them over a cluster."""
