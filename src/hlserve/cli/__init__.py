"""The ``hlserve`` command line: ``main`` (the console entry point ``hlserve.cli:main``) and its
subcommands, in ``commands`` (tiny-model, generate, demo, serve), ``measure`` (bench, sweep) and
``simulate`` (cost, calibrate, study)."""

from hlserve.cli.commands import main

__all__ = ["main"]
