"""`python -m dynctl.sim <sglang launch_server arguments>`."""

import sys

from dynctl.sim.server import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
