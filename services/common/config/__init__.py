"""The configuration: the manifest model, loading and validating a config folder, agent
presets, templates and egress rules."""
