"""Console entry points; each is a thin Hydra app over the library."""
