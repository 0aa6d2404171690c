"""The two interpreters of one step program: the SimPy engine (streams, shared links, overlap,
stragglers) and the closed-form walk (critical path with named parts)."""
