"""pytest plugin for every pytest suite ctest runs (PYTEST_PLUGINS, set by the root
CMakeLists.txt): skips made visible.

pytest exits 0 when every test skipped, which ctest counts as a pass. With this plugin a
session whose tests all skipped exits 77 (ctest's SKIP_RETURN_CODE for every entry), and every
skip is appended, with its reason, to the file $BRAGG_SKIP_FILE names, for `make test`'s list
of skips (scripts/test-summary).
"""

import os

SKIPPED_EXIT = 77


def _reason(report):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    reason = reason.replace("\n", " ").strip()
    if reason.startswith("Skipped: "):
        reason = reason[len("Skipped: "):]
    return reason or "(no reason given)"


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    skipped = reporter.stats.get("skipped", [])
    if not skipped:
        return
    path = os.environ.get("BRAGG_SKIP_FILE")
    if path:
        with open(path, "a") as f:
            for report in skipped:
                f.write(f"{report.nodeid}: {_reason(report)}\n")
    ran = any(reporter.stats.get(k) for k in ("passed", "failed", "error", "xfailed", "xpassed"))
    if exitstatus == 0 and not ran:
        session.exitstatus = SKIPPED_EXIT
