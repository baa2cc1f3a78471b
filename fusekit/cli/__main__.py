"""``python -m fusekit.cli``: the ``fusekit`` command line (every command)."""

from . import main

main(prog_name="fusekit")
