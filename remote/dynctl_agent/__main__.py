"""`python -m dynctl_agent` answers one request from stdin."""

import sys

from dynctl_agent.verbs import main

sys.exit(main())
