"""Every input kdbench makes or reads: synthetic image batches, the standard library's text corpus, tokenizers and
the quality data sets; the workloads' batch hooks call into it."""
