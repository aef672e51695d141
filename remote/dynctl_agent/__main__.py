"""`python -m dynctl_agent` answers one request from stdin; `--op REQUEST` runs an operation's worker."""

import sys

if len(sys.argv) == 3 and sys.argv[1] == "--op":
    from dynctl_agent.operations import run_operation

    sys.exit(run_operation(sys.argv[2]))

from dynctl_agent.verbs import main  # noqa: E402

sys.exit(main())
