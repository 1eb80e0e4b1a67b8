"""``python -m mpsnn``: the ``mpsnn`` command (also what ``torchrun -m mpsnn`` and ``mpsnn
train --nproc`` run in each rank)."""

from mpsnn.cli import main

if __name__ == "__main__":
    main(prog_name="mpsnn")
