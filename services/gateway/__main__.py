"""Runs the gateway process: ``python -m services.gateway --help``."""

import sys

from services.gateway.process import main

sys.exit(main())
