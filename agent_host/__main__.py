"""``python -m agent_host``: the same as ``agent-host``."""

import sys

from .cli import main

sys.exit(main())
