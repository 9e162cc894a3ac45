"""The chaos tests reuse the Python suite's Agent and fixtures (tests/pbox/python/conftest.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_path = Path(__file__).resolve().parents[1] / "python" / "conftest.py"
_spec = importlib.util.spec_from_file_location("pbox_suite_conftest", _path)
suite = importlib.util.module_from_spec(_spec)
sys.modules["pbox_suite_conftest"] = suite
_spec.loader.exec_module(suite)

pboxd_binary = suite.pboxd_binary
make_agent = suite.make_agent
no_leftover_cgroup_parents = suite.no_leftover_cgroup_parents
