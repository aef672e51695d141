"""A program the agent runs with the server's interpreter (sgltree.import_check_candidates): `python -m
sglang.launch_server --help` as it would run once the candidates are swapped in, while sglang's tree stays
as it is. argv[1]: {module name: [candidate, target]} as JSON. Each of those modules is compiled from its
candidate's text under its target's name (its __file__ and every traceback name the target), and no bytecode
is read for it or written for any module, so nothing of the tree changes."""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import runpy
import sys


class CandidateLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname, target, candidate):
        super().__init__(fullname, target)
        self.candidate = candidate

    def get_data(self, path):
        if path == self.path:
            with open(self.candidate, "rb") as f:
                return f.read()
        return super().get_data(path)

    def get_code(self, fullname):
        # never the target's cached bytecode: that is the old text's
        return compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)


class CandidateFinder(importlib.abc.MetaPathFinder):
    def __init__(self, modules):
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        candidate, target_path = self.modules[fullname]
        package = os.path.basename(target_path) == "__init__.py"
        return importlib.util.spec_from_file_location(
            fullname, target_path, loader=CandidateLoader(fullname, target_path, candidate),
            submodule_search_locations=[os.path.dirname(target_path)] if package else None)


if __name__ == "__main__":
    sys.dont_write_bytecode = True
    sys.meta_path.insert(0, CandidateFinder(json.loads(sys.argv[1])))
    sys.argv = ["launch_server", "--help"]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
