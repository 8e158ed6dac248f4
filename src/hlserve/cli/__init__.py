"""The ``hlserve`` command line: ``main`` (the console entry point ``hlserve.cli:main``) and its
subcommands, in ``main`` (tiny-model, generate, demo, serve), ``measure`` (bench, sweep) and
``simulate`` (cost, calibrate, study)."""

from hlserve.cli.main import main

__all__ = ["main"]
