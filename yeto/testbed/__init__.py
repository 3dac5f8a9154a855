"""What tests and benchmarks put yeto under: the user-space WAN link emulator (`netem`). Not used by a run."""
