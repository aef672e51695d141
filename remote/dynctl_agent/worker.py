"""The detached worker of an operation, run as a file: `python ROOT/dynctl_agent/worker.py ROOT REQUEST`.

op_start starts it (operations.spawn_detached) with the interpreter that runs the agent and this copy of
the agent at ROOT; it runs the operation that REQUEST (workdir/ops/<id>.json) describes and leaves its
records beside it.
"""

import sys

if __name__ == "__main__":
    # this file's folder is the package itself, not a folder of modules: the agent's copy comes first instead
    sys.path[0] = sys.argv[1]
    from dynctl_agent.operations import run_operation

    sys.exit(run_operation(sys.argv[2]))
