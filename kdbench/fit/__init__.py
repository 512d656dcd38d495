"""Will it fit: each cell's peak memory of one device predicted without allocating it (:mod:`.planner`, a fake
run of the cell's own distillation step under ``FakeTensorMode``, metered by :mod:`.tracker`), judged against a
device's memory (:mod:`.devices`, :mod:`.verdict`)."""
