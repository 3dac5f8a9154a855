"""Watching a run: `yeto dashboard`'s snapshot of the tape and the islands' files, its page, and its server."""
