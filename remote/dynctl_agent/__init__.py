"""dynctl's host agent: a stdlib-only package shipped to hosts as one archive, fed JSON, answering JSON.

Every verb is idempotent and does its whole transaction here on the host, so a dropped SSH connection
never leaves half a change. See verbs.py for the map of verbs to modules.
"""
