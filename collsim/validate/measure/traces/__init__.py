"""Read PyTorch profiler (Kineto) traces, break their steps down by op kind, compare them with a
simulated step, and build a device profile from the kernels they timed. Reading needs no torch."""
