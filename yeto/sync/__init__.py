"""DiLoCo synchronization: layout (fragments), quant (wire precision), outer (merge math),
protocol (ZeroMQ messages), client (learner side), server (the syncer)."""
