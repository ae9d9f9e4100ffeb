"""The test harness that tests, ``python -m stress`` and ``python -m bench`` drive a sender
with: a decode peer process (:mod:`stress.harness.peer`, run as ``python -m
stress.harness.peer``), fault injection wrapped around a real transport
(:mod:`stress.harness.faults`), a reference driver of a sender's rooms
(:mod:`stress.harness.driver`), and the stamp/landing audit of the pages a peer received
(:mod:`stress.harness.stamps`, :mod:`stress.harness.landings`).

Not part of the sender: nothing in :mod:`sender` or :mod:`staging` imports it. It needs the
``sender`` extra, as the sender does.
"""
