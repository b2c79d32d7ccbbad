"""terrapipe.pipeline: FastLoader, its sources and transforms (imports kernels, never comm)."""
