"""terrapipe.comm: process groups and collectives (imports kernels, never pipeline)."""
