"""The processes: each module here has a ``main`` (a console script) and runs with ``python -m``.

- ``server``: create the detached group from a spec and publish its record (``tg-server``; the
  operator's Ray job, and ``tgctl up``).
- ``client_job``: the client Job: wait for Ready, attach by name, train (``tg-client``).
- ``teardown``: remove a group's actors and placement groups (``tg-teardown``; the finalizer).
- ``cli``: ``tgctl``, the local mode.
"""
