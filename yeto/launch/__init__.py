"""Launching fleets: `local` runs a syncer and N learners on this machine."""
