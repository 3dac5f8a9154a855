"""The I/O shells around the cores: server, client, disk store and tape, keys and gatekeeper."""
