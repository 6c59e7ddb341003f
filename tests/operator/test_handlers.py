"""Handler registration and kopf settings (no cluster needed)."""

from __future__ import annotations

import logging

import kopf

from tg_operator import handlers, names
from tg_operator.settings import OperatorConfig


def test_settings_use_our_finalizer_prefixes_and_standalone_mode() -> None:
    settings = kopf.OperatorSettings()
    handlers.configure_settings(
        settings, OperatorConfig.from_env({"TG_WATCH_TIMEOUT_SECONDS": "120"})
    )
    assert settings.persistence.finalizer == "trainergroup.io/finalizer" == names.FINALIZER
    progress = settings.persistence.progress_storage
    diffbase = settings.persistence.diffbase_storage
    assert isinstance(progress, kopf.AnnotationsProgressStorage)
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert progress.prefix == diffbase.prefix == "kopf.trainergroup.io"
    assert settings.watching.server_timeout == 120
    assert settings.peering.standalone is True
    assert settings.scanning.disabled is True
    assert settings.posting.level == logging.INFO


def test_every_handler_is_registered_on_an_explicit_registry() -> None:
    registry = kopf.OperatorRegistry()
    handlers.register(registry, OperatorConfig.from_env({"TG_HEALTH_INTERVAL_SECONDS": "7"}))
    changing = registry._changing.get_all_handlers()
    by_id = {(h.id, str(h.reason.value) if h.reason else "resume") for h in changing}
    assert by_id == {
        ("reconcile", "create"),
        ("reconcile/spec", "update"),
        ("reconcile", "resume"),
        ("cleanup-ray", "delete"),
    }
    # one daemon per TrainerGroup (no timer), never cancelled while it cleans up
    daemons = registry._spawning.get_all_handlers()
    assert [(d.id, getattr(d, "cancellation_timeout", "timer")) for d in daemons] == [
        ("group-loop", None)
    ]
    # the watches that wake the loops, and the indexes its passes read
    watching = {h.id for h in registry._watching.get_all_handlers()}
    assert watching == {"raycluster-changed", "raypod-changed", "tinker-changed", "gateway-sync"}
    indexing = {h.id for h in registry._indexing.get_all_handlers()}
    assert indexing == {
        handlers.CLUSTER_INDEX, handlers.POD_INDEX, handlers.TINKER_INDEX, handlers.GATEWAY_INDEX
    }
    activities = {
        h.activity.value for h in registry._activities.get_all_handlers() if h.activity
    }
    assert {"startup", "cleanup", "authentication"} <= activities
    # importing the module registered nothing globally
    assert not kopf.get_default_registry()._changing.get_all_handlers()
