"""``python -m mfsdp_hotfix`` is ``mfsdp-hotfix``."""

import sys

from .cli import main

sys.exit(main())
