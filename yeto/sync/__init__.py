"""DiLoCo synchronization: `core` (the pure state machines), `wire` (layout, quantization, messages), `merge` (the
math), `shell` (server, client, disk, keys) and the simulator that runs the cores through seeded faults."""
