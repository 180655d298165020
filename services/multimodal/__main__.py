"""Runs the multimodal service: ``python -m services.multimodal --help``."""

import sys

from services.multimodal.service import main

sys.exit(main())
