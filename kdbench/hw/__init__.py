"""Hardware: the backend a cell runs on (cpu, cuda, rocm) and what follows from it, its clocks, the environment it
records, where tensors are placed, and how much slower a 16-bit precision runs here."""
