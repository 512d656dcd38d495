"""Measuring: the only code that times models, the same for every family of pair: the timed loop and its
statistics, the row toolkit (:mod:`.rows`), the distillation step's measurement (:mod:`.step`), memory, FLOPs,
telemetry and energy, traces, levers, serving runtimes, data parallelism, and failures as rows."""
