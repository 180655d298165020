"""Runs the worker service: ``python -m services.worker --help``."""

import sys

from services.worker.service import main

sys.exit(main())
