"""The shipped configs, as package data: ``tandem run NAME`` finds ``NAME.yaml`` here
(through :data:`tandem.core.paths.CONFIGS_DIR`), from any directory, installed or not."""
