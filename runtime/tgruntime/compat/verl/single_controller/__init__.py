"""verl's ``verl.single_controller``: ``base`` (workers, decorator) and ``ray``."""
