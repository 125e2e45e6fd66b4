"""``python -m harness.report SWEEP_DIR``: the sweep's report (harness/report/sweep.py)."""

import sys

from .sweep import main

sys.exit(main())
