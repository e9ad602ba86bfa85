"""``python -m llmserve``: the ``llmserve`` command."""

import sys

from llmserve.cli import main

sys.exit(main())
