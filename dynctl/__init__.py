"""dynctl: safe deploys, rollbacks and a live view for SGLang GPU hosts."""

__version__ = "0.1.0"
