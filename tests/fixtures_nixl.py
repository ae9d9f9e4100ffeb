"""Fixtures for tests that use real NIXL agents and decode-peer processes."""
