"""NIXL KV sender: transport, manager and per-room sender (see docs/THREADING.md)."""
