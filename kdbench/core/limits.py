"""kdbench's policy thresholds: the figures past which a row is flagged or a change is called out, each defined once.

Apart from :mod:`kdbench.core.names` (what things are called) because these are judgements, each with its reason,
and a change to one changes verdicts: the fit planner's tolerance, the accuracy ledger's bound and the share of the
cores below which a measurement counts as contended.  Torch-free, on the base floor: the column table documents
them (:mod:`kdbench.core.schema`) and the store, the report and the measuring code read them alike.
"""

from __future__ import annotations

# The fit planner's stated tolerance (issue 31): a distill_step row whose measured peak (live_peak_bytes) lies
# outside [low, high] x its predicted peak (predicted_peak_bytes) says so in its notes, and the report flags it.
FIT_TOLERANCE = (0.90, 1.10)
# The step-time model's stated tolerance (issue 43): a distill_step row whose measured median_ms lies outside
# [low, high] x its predicted step time (predicted_step_ms) says so in its notes.
STEP_TIME_TOLERANCE = (0.67, 1.5)

# The accuracy ledger's bound (``compare --max-loss-err``): an LM cell whose loss_rel_err or grad_rel_err against
# float64 exceeds it is named in compare's note (kdbench.report.ledger)
MAX_LOSS_ERR = 1e-2

# Contention (issue 32, kdbench.hw.contention): a measurement is `contended` when other processes left it fewer than
# this share of the cores its threads need.  0.75: one other single-threaded process beside a 1-thread measurement
# on 2 cores (CI's two pytest-xdist workers) leaves it 1.0 of 1.0 (not flagged, with room for kernel threads and
# daemons); two CPU-bound ones share the 2 cores fairly with it and leave it 2/3 (flagged).
CONTENDED_FREE_SHARE = 0.75
