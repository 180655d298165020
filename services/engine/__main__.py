"""Runs one engine replica as a process: ``python -m services.engine --help``."""

import sys

from services.engine.process import main

sys.exit(main())
