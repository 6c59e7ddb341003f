"""tgruntime: the code that runs inside Ray.

Packages and modules:

- ``controller``: the single-controller layer (Worker, ResourcePool, WorkerGroup,
  register/Dispatch, DataProto, group records, teardown, health).
- ``verl_compat``: verl's names over ``controller`` so verl code ports by imports.
- ``trainer``: the Megatron trainer worker.
- ``groups``: TrainerGroup spec -> a running detached group (used by server and tgctl).
- ``server`` / ``client`` / ``teardown``: the entrypoints the operator runs as Ray jobs.
- ``cli``: ``tgctl``, the local mode.
"""
