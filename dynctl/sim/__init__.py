"""A simulated SGLang 0.5.x server: the demo host of SPEC §8 and the test double for everything dynctl does.

It is started the way sglang is (`python -m dynctl.sim <launch_server arguments>`), reads the real sglang
source tree installed next to it (without importing it), and from the outside behaves like sglang 0.5.9:
same process tree, log lines, HTTP endpoints, metrics, SIGTERM drain and failure modes. What it cannot have
(a GPU, a model) is replaced by a batching model whose step times are GPU measurements (costmodel.py) and
a fake `nvidia-smi`. It says SIMULATED in its banner and in `/model_info`.
"""
