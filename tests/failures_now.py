"""A pytest plugin for runs that may be cut short (an accelerator session's capped suite): each failure's traceback
is appended to the file ``$LCONV_FAILURES_LOG`` as soon as the test ends, not at the run's end, which a run killed at
its cap never reaches. Under pytest-xdist the controller gets every worker's reports, so one file holds them all.

    LCONV_FAILURES_LOG=/tmp/failures.log PYTHONPATH=tests python -m pytest -p failures_now -n 8 tests
"""
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("LCONV_FAILURES_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes, once
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
