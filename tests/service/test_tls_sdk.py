"""HTTPS (issue 37): a CA and a server certificate made here, a second Tinker server over the
package's group with ``--tls-cert``/``--tls-key``, and the unmodified tinker SDK driving it with
``TINKER_BASE_URL=https://...`` and the CA bundle in ``SSL_CERT_FILE`` (httpx, under the SDK,
reads it: httpx._config.create_ssl_context). Plain HTTP to the TLS port gets no answer, a
client without the CA refuses the server, and a renewed certificate is served without a
restart."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.service.pki import make_pki
from tests.service.test_sdk_flow import WAIT, _batch

pytestmark = [pytest.mark.ray, pytest.mark.megatron]

tinker = pytest.importorskip("tinker")
T = tinker.types


def _healthz(url: str, ctx: ssl.SSLContext | None) -> int:
    with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=30, context=ctx) as r:
        return int(r.status)


def _capabilities(base: str, key: str) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"{base}/api/v1/get_server_capabilities", headers={"X-API-Key": key}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(r.status), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _through_a_gateway(
    url: str, ca_file: Path, served: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: the gateway verifies an https:// group against that group's own CA (``--ca-file``
    here; a TrainerGroup's spec.api.tls.caBundle in Kubernetes); without it, the group's
    private certificate is refused and the caller gets a 502 that says why."""
    from tgruntime.gateway.__main__ import Running as GatewayRunning
    from tgruntime.gateway.app import Gateway
    from tgruntime.gateway.groups import GroupSource, from_flags, read_ca

    def gateway(ca: str) -> Any:
        source = GroupSource(fixed=from_flags([f"tls={url}"], ca=ca))
        return GatewayRunning(
            Gateway(source=source, timeout_s=60, connect_timeout_s=10, max_body_bytes=1 << 24),
            host="127.0.0.1", port=0,
        ).start()

    trusting = gateway(read_ca(str(ca_file), "test"))
    try:
        status, caps = _capabilities(trusting.url, served["key"])
        assert status == 200, caps
        assert served["base"] in [m["model_name"] for m in caps["supported_models"]]
        monkeypatch.setenv("TINKER_BASE_URL", trusting.url)  # plain HTTP to the gateway
        monkeypatch.delenv("SSL_CERT_FILE")
        with tinker.ServiceClient() as sc:
            tc = sc.create_lora_training_client(base_model=served["base"], rank=8).result()
            fb = tc.forward_backward(_batch(0), "cross_entropy").result(timeout=WAIT)
            assert fb.metrics["loss:sum"] > 0
    finally:
        trusting.stop()
    public = gateway("")  # the system's roots only
    try:
        status, err = _capabilities(public.url, served["key"])
        assert status == 502, err
        assert "'tls'" in err["error"] and "CERTIFICATE_VERIFY_FAILED" in err["error"], err
    finally:
        public.stop()


def test_tls_flags_are_checked_naming_the_flag(tmp_path: Path) -> None:
    from tgruntime.service.tls import check_files

    pki = make_pki(tmp_path)
    assert check_files(cert=None, key=None) is None
    with pytest.raises(ValueError, match="--tls-cert needs --tls-key"):
        check_files(cert=str(pki["cert"]), key=None)
    with pytest.raises(ValueError, match="--tls-key needs --tls-cert"):
        check_files(cert=None, key=str(pki["key"]))
    with pytest.raises(ValueError, match=r"--tls-key .*nope: not a readable file"):
        check_files(cert=str(pki["cert"]), key=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="cannot load them as a PEM certificate"):
        check_files(cert=str(pki["ca"]), key=str(pki["key"]))  # the key is not the CA's
    files = check_files(cert=str(pki["cert"]), key=str(pki["key"]))
    assert files is not None and files.cert == str(pki["cert"])


def test_the_sdk_trains_and_samples_over_https_with_the_ca_bundle(
    served: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from tgruntime.service.__main__ import Running, build_service
    from tgruntime.service.auth import KeyStore
    from tgruntime.service.tls import check_files

    pki = make_pki(tmp_path / "pki")
    files = check_files(cert=str(pki["cert"]), key=str(pki["key"]))
    service = build_service(
        served["client"], served["info"], KeyStore(keys_file=str(served["keys_file"]))
    )
    running = Running(service, "127.0.0.1", 0, tls=files, tls_reload_s=0.2).start()
    try:
        url = running.url
        assert url.startswith("https://127.0.0.1:")
        # the SDK, unmodified: base URL, key and CA bundle from the environment
        monkeypatch.setenv("TINKER_BASE_URL", url)
        monkeypatch.setenv("TINKER_API_KEY", served["key"])
        monkeypatch.setenv("SSL_CERT_FILE", str(pki["ca"]))
        with tinker.ServiceClient() as sc:
            tc = sc.create_lora_training_client(base_model=served["base"], rank=8).result()
            losses = []
            for _ in range(2):
                fb = tc.forward_backward(_batch(0), "cross_entropy").result(timeout=WAIT)
                tc.optim_step(T.AdamParams(learning_rate=1e-2)).result(timeout=WAIT)
                losses.append(fb.metrics["loss:sum"])
            assert losses[1] < losses[0]
            sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
            got = sampler.sample(
                T.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                sampling_params=T.SamplingParams(max_tokens=3, stop=[]),
            ).result(timeout=WAIT)
            assert len(got.sequences[0].tokens) == 3
            runs = tinker.RestClient().list_training_runs().result().training_runs
            assert tc.model_id in [r.training_run_id for r in runs]
        _through_a_gateway(url, pki["ca"], served, monkeypatch)
        # a client with the CA verifies the server; one with the public CAs only refuses it
        import certifi

        with_ca = ssl.create_default_context(cafile=str(pki["ca"]))
        assert _healthz(url, with_ca) == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _healthz(url, ssl.create_default_context(cafile=certifi.where()))
        # plain HTTP to the TLS port: no HTTP answer at all (no 401, no 400 page)
        plain = url.replace("https://", "http://")
        req = urllib.request.Request(
            f"{plain}/api/v1/create_session", data=json.dumps({"tags": []}).encode(),
            headers={"X-API-Key": served["key"], "Content-Type": "application/json"},
        )
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert not isinstance(refused.value, urllib.error.HTTPError), refused.value
        # a renewed certificate (a new CA, as after a rotation) is served without a restart
        new = make_pki(tmp_path / "renewed", serial_cn="renewed")
        Path(pki["cert"]).write_bytes(new["cert"].read_bytes())
        Path(pki["key"]).write_bytes(new["key"].read_bytes())
        new_ca = ssl.create_default_context(cafile=str(new["ca"]))
        deadline = time.monotonic() + 30
        while True:  # the reload loop checks every 0.2 s here (every minute by default)
            try:
                assert _healthz(url, new_ca) == 200
                break
            except urllib.error.URLError:
                assert time.monotonic() < deadline, "the renewed certificate was not served"
                time.sleep(0.2)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _healthz(url, with_ca)  # the old CA does not sign the new certificate
    finally:
        running.stop()
