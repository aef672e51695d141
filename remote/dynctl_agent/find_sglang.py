"""A program the agent runs with the server's interpreter (hostinfo.run_python), which need not be the agent's:
loads dynctl/base/sglang.py by its path (`argv[1]`, compiled beside it at upload) and asks it where sglang is,
without importing sglang; prints {"python", "python_version", "sglang"} as JSON."""

import importlib.util
import json
import sys

if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("dynctl_sglang", sys.argv[1])
    facts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(facts)
    print(json.dumps({"python": sys.executable, "python_version": "%d.%d.%d" % sys.version_info[:3],
                      "sglang": facts.find_installed()}))
