"""A TrainerGroup spec made into a running detached group (used by the server and tgctl)."""
