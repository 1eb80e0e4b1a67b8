"""``python -m mpsnn.cli``: the ``mpsnn`` command without the installed entry point."""

from mpsnn.cli import main

main()
