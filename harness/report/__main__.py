"""``python -m harness.report SWEEP_DIR``: the sweep's report (harness/report/sweep.py)."""

import sys

from harness.signals import exit_at_startup_interrupts

exit_at_startup_interrupts("report")  # before matplotlib's and torch's imports

from harness.config import ctrl_c_is_one_line  # noqa: E402

from .sweep import main  # noqa: E402

sys.exit(ctrl_c_is_one_line(main, "report", "--out holds the whole new report or what it held before (a report is "
                                              "moved there whole)"))
