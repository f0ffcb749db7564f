"""``python -m shardkit.cli`` is the ``shardkit`` command."""

import sys

from shardkit.cli import main

sys.exit(main())
