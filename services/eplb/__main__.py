"""Runs the EPLB planner service: ``python -m services.eplb --help``."""

import sys

from services.eplb.service import main

sys.exit(main())
