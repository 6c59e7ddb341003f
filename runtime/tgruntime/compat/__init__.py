"""Compatibility layers: other frameworks' names over :mod:`tgruntime.controller`
(``verl``: verl's single controller)."""
