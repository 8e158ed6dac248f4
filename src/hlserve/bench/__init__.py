"""Measurement over HTTP and in process: workload clients, `hlserve bench`, `hlserve sweep`, reports."""
