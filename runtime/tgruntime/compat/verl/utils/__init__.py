"""verl's ``verl.utils`` modules that workers use: ``tensordict_utils``."""
