"""The check's stages, one module each (the plan's order): :mod:`.clocks` (clocks, idle), :mod:`.math_mode`
(math), :mod:`.syncs`, :mod:`.telemetry`, :mod:`.memory`, :mod:`.phases`, :mod:`.suites` (probe, suite, levers,
report) and :mod:`.lm`.  A check prints its verdicts into the :class:`~gpu.report.Report` it is given; on the CPU
a stage that needs a GPU says "no GPU" and checks nothing."""
