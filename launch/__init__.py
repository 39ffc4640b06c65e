"""The composition root: the `ddtree-serve` command and the local three-service stack (nothing imports this)."""
