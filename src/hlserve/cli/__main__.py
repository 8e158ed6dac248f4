"""``python -m hlserve.cli ...`` runs as ``hlserve ...`` does (subprocesses start the server
this way, with the interpreter they run under)."""

import sys

from hlserve.cli import main

sys.exit(main())
