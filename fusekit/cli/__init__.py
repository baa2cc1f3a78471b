"""The ``fusekit`` command line: the top-level group ``main``, with every command group registered.

Commands live in one module per group: patterns (patterns ls/show, oracle), run (run, bench),
autotune, cache, doctor, pipeline; common holds what they share. Every command either works or stops with
one ``Error: ...`` line (exit code 1, or 2 for bad options).
"""

from __future__ import annotations

import click

from fusekit import config

from . import autotune, cache, doctor, patterns, pipeline, run
from .autotune import SpecError, load_spec, parse_bytes, parse_spec, plot_tuning
from .common import Group, check_tune_input, parse_attr, parse_shape, tuning_summary
from .run import torch_references


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(config.__version__, prog_name="fusekit")
def main() -> None:
    """fusekit: fused NN layers as cuDNN frontend graphs, described by pattern files."""


main.add_command(patterns.patterns)
main.add_command(patterns.oracle_cmd)
main.add_command(doctor.doctor)
main.add_command(run.run_cmd)
main.add_command(run.bench_cmd)
main.add_command(autotune.autotune_cmd)
main.add_command(cache.cache_group)
main.add_command(pipeline.pipeline)

__all__ = [
    "SpecError",
    "check_tune_input",
    "load_spec",
    "main",
    "parse_attr",
    "parse_bytes",
    "parse_shape",
    "parse_spec",
    "plot_tuning",
    "torch_references",
    "tuning_summary",
]
