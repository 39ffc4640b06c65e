"""GPU kernels both model services run (Triton, imported lazily where it is installed): tree attention over a
slot cache, which the target's verify blocks and the drafter's block forward share."""
