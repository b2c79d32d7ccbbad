"""terrapipe.engine: data-parallel training over terrapipe.comm and terrapipe.pipeline."""
