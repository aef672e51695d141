"""`python -m sglang.launch_server` for lifecycle tests: runs tests/servers/lifecycle_server.py."""

import os
import runpy
import sys

if __name__ == "__main__":
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.argv[0] = os.path.join(here, "lifecycle_server.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
