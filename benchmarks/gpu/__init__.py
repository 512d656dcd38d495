"""GPU check: what kdbench's GPU paths measure, checked on a real GPU in one device command.

Run it by hand on a fresh CUDA or ROCm machine (pytest does not collect it):

    python benchmarks/gpu_check.py                    # the first visible GPU; files under a temp folder
    python benchmarks/gpu_check.py --out gpu-check    # the few files to copy back, in gpu-check/
    python benchmarks/gpu_check.py --quick            # a selection with margin in a 10-minute command

It prints its plan (each stage's seconds on a warm H100 or H200, from gpu-review-2 to -4) and checks, printing
each figure beside its verdict:

1. clocks: a GPU-bound GEMM and a host-bound loop of tiny kernels, timed with kdbench's
   device-event clock and with synchronised wall time, agree within 10 %; the GEMM is not
   flagged launch-bound and the loop is;
2. math: every precision sets the TF32 switches it should (fp32, bf16, fp16: off; tf32: on),
   the legacy and the new flag getters answer inside ``math_mode`` and agree with it, and fp32
   matmuls and convolutions are IEEE fp32 by their error against float64;
3. idle: a device event pair around a 200 ms host sleep times the gap (every one_off_ms relies on it);
4. syncs: a distillation step has no host-device sync (``torch.cuda.set_sync_debug_mode("error")``), and
   an LM step (fused_linear) none either; a liger step has exactly liger-kernel's own (LIGER_SYNCS per
   step, counted in ``"warn"`` mode), and transformers' LM forward its own
   (TRANSFORMERS_SYNCS_PER_FORWARD), said so; a cross-tokenizer step and a dynamic-cache decode none;
5. telemetry: the management library (NVML or amdsmi) reads the GPU torch uses (UUID or
   PCI address, read back from the library), and the energy counter agrees with the
   integral of the sampled power within 25 %;
6. memory: after a cell, the device's allocated memory is back at its baseline, and a
   cell measured twice reports the same peaks;
7. phase stamps: the step time with and without phase events, over paired rounds (5 %);
8. `kdbench probe`: every ceiling is measured or says why not;
9. suites/gpu-smoke.yaml: every row is ok (tf32 may be skipped, with its reason) and
   0 < mfu <= 1 (or, on a GPU without a datasheet entry, 0 < ceiling_utilization <= 1);
10. suites/gpu-levers.yaml: every lever once; every row ok or skipped with its reason, every
    compiled row with one_off_ms > 0;
11. suites/gpu-lm.yaml: every loss_impl, a bf16-held teacher, the top-k cache, an on-policy step,
    prefill and decode on every generation backend, speculative decoding at T 0 and 1, a cross-tokenizer
    cell; every row ok or skipped with its reason, every ok row with its attention kernel
    (attention_kernel), 0 < mfu <= 1 and the accuracy ledger within its bound on its steps, what a decode
    served and its tokens checked (ok, or ok to a near-tie);
12. fit: a GiB-scale cell (qwen2.5-1.5b -> 0.5b, 2 x 2,048 tokens) predicted, and on a GPU measured against
    max_memory_allocated, memory_reserved and the context;
13. the report of the runs renders (not with ``--quick``: ``kdbench report`` renders results.tar.gz).

Every ``kdbench run`` gets ``--cell-timeout`` (default 240 s), so no cell outlasts a device command.
``--quick`` measures memory once fewer, pairs fewer phase rounds, and runs a subset of each image suite
(written into the scratch folder), and the LM suite whole (12 tiny cells, every ``loss_impl`` and generation
path).  It says
which torch, transformers and liger-kernel it ran with.  Everything lands in ``--out`` in a few files:
``summary.txt`` (the review's five first-run numbers against their H200 ranges, the counts, the
wall time, torch, device, date), ``check.log`` (all that was printed), ``results.tar.gz`` (the
runs and the probe), ``report.tar.gz`` and ``probe.parquet``; they are rewritten after every
stage, so a failure, a time-out or SIGTERM still leaves what was done.

It ends with exit code 0 when every check passed, 1 otherwise (the first-run numbers are
reported, not counted).  ``--device cpu`` runs the checks that mean something on the CPU
(clocks, math flags, phases, probe, a suite), to try the script itself on a machine without a
GPU; ``--device cpu --quick`` runs the math flags and the probe only, and the rest say "no GPU".
The LM stage needs transformers (kdbench's ``lm`` extra) and, for its liger cell, liger-kernel; a box
without them gets them from benchmarks/device/run_check.py's wheels (docs/gpu-check.md).

The package, one job a module: :mod:`.plan` (the stages and their seconds), :mod:`.report` (the verdicts, the
first-run figures and summary.txt), :mod:`.runs` (``kdbench`` in a subprocess, the quick suites), :mod:`.steps`
(the cells the checks build, through their workload as ``kdbench run`` builds them), ``checks/`` (one module per
stage) and :mod:`.main` (the command line, the stages in order, the files in ``--out``).
``benchmarks/gpu_check.py`` is the command: its folder is on ``sys.path`` when it runs, so this package imports as
``gpu`` (benchmarks/ is not a package).
"""
