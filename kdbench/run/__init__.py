"""Running: the one engine that turns a suite's plan into jobs, hands them to workers (a process, inline, torchrun,
or an outer allocation's ranks) and stores their rows; and the cell orchestrator (:mod:`.cell`), which looks a
cell's workload up once and hands it down.  It never measures itself."""
