"""Watching a run: metrics sinks (metrics), the phase clock (phases), the hang watchdog (watchdog), whether it
is as fast as its profile says (health), golden steps from a pre-flight rehearsal (golden)."""
