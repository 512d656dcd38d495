"""kdbench.workloads.lm.workload."""
