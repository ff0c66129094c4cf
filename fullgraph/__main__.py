"""``python -m fullgraph``: the command line, as the ``fullgraph`` script runs it (for
an environment whose scripts are not on the PATH, and for ``torchrun -m fullgraph``)."""
import sys

from fullgraph.cli import main

if __name__ == "__main__":
    sys.exit(main())
