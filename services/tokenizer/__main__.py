"""Runs the tokenizer service: ``python -m services.tokenizer --help``."""

import sys

from services.tokenizer.service import main

sys.exit(main())
