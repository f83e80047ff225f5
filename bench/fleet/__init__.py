"""The fleet simulation's model (``python -m bench.fleet_sim``; docs/fleet.md)."""
