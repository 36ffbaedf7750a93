"""Loaded by every Python process of a test server whose ``PYTHONPATH`` holds this folder:
installs the injected engine faults (``tests/engine_faults.py``) when the test asks for them."""

import os
import sys

if os.environ.get("JIUWEN_ENGINE_FAULTS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import engine_faults

    engine_faults.install_from_env()
