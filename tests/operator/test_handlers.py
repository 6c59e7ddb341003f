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
        ("reconcile", "update"),
        ("reconcile", "resume"),
        ("cleanup-ray", "delete"),
    }
    timers = registry._spawning.get_all_handlers()
    assert [t.interval for t in timers] == [7.0]
    activities = {h.activity.value for h in registry._activities.get_all_handlers()}
    assert {"startup", "cleanup", "authentication"} <= activities
    # importing the module registered nothing globally
    assert not kopf.get_default_registry()._changing.get_all_handlers()


def test_the_timer_stays_out_while_the_reconcile_handler_retries() -> None:
    from tg_operator.health import handlers_busy

    assert handlers_busy({"kopf.trainergroup.io/reconcile": '{"retries": 2}'})
    assert not handlers_busy({"kopf.trainergroup.io/last-handled-configuration": "{}"})
    assert not handlers_busy({})
