"""The driver's side of a running group: ``TrainerClient`` (attach by name, futures) and the
client's training batches."""
