"""``python -m specimg.cli`` (and ``torchrun -m specimg.cli``) is ``specimg``."""

from specimg.cli.app import main

main()
