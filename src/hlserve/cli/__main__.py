"""``python -m hlserve.cli ...`` runs as ``hlserve ...`` does (subprocesses start the server
this way, with the interpreter they run under)."""

import sys

from hlserve.cli import main

if __name__ == "__main__":  # not when merely imported (a walk over the package's modules)
    sys.exit(main())
