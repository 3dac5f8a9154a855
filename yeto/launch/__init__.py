"""Launching fleets: `local` runs a syncer and N islands on this machine."""
