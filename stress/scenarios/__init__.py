"""Stress scenarios, one module each.

Every public module here is imported by :func:`stress.framework.load_scenarios` and
registers its scenario with :func:`stress.framework.register` at import time. To add a
scenario, drop a module here; nothing else changes.
"""
