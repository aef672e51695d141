"""A program the agent runs with the server's interpreter (hostinfo.run_python), which decides what compiles:
py_compile each candidate of `argv[1]` ([[candidate, target], ...] as JSON); prints one JSON list whose
results name the target."""

import json
import os
import py_compile
import sys
import tempfile

if __name__ == "__main__":
    out = []
    for cand, target in json.loads(sys.argv[1]):
        fd, cfile = tempfile.mkstemp(suffix=".pyc")
        os.close(fd)
        try:
            # the candidate's own name: CPython re-reads the error's source line from that file
            py_compile.compile(cand, cfile=cfile, doraise=True)
            out.append({"target": target, "ok": True})
        except py_compile.PyCompileError as e:
            v = e.exc_value
            out.append({"target": target, "ok": False, "type": e.exc_type_name,
                        "msg": getattr(v, "msg", None) or str(v), "lineno": getattr(v, "lineno", None),
                        "line": ((getattr(v, "text", None) or "").strip().splitlines() or [""])[0][:160]})
        finally:
            os.unlink(cfile)
    print(json.dumps(out))
