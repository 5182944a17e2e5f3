import pytest

from kvconnect.config import KVTransferConfig
from kvconnect.connector import KVConnectorContext, KVConnectorFactory, KVConnectorRole
from kvconnect.connector.multi import MultiConnector
from tests.connector.helpers import MODULE, Recording, transfer_config


def test_out_of_tree_connector_by_module_path() -> None:
    ctx = KVConnectorContext(transfer_config("Recording"))
    c = KVConnectorFactory.create_connector(ctx, KVConnectorRole.WORKER)
    assert isinstance(c, Recording) and c.role is KVConnectorRole.WORKER


def test_registered_by_name_and_duplicates_refused() -> None:
    KVConnectorFactory.register_connector("TestRecording", MODULE, "Recording")
    try:
        cfg = KVTransferConfig(kv_connector="TestRecording", kv_role="kv_both")
        c = KVConnectorFactory.create_connector(KVConnectorContext(cfg), KVConnectorRole.SCHEDULER)
        assert isinstance(c, Recording)
        with pytest.raises(ValueError, match="already registered"):
            KVConnectorFactory.register_connector("TestRecording", MODULE, "Recording")
    finally:
        del KVConnectorFactory._registry["TestRecording"]


def test_multiconnector_is_built_in() -> None:
    assert "MultiConnector" in KVConnectorFactory.registered_connectors()
    cfg = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [{"kv_connector": "Recording", "kv_connector_module_path": MODULE}]
        },
    )
    assert KVConnectorFactory.get_connector_class(cfg) is MultiConnector


def test_unknown_and_bad_names_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown KV connector 'Nope'; registered: .*MultiConn"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="Nope", kv_role="kv_both")
        )
    with pytest.raises(ValueError, match="cannot import"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(
                kv_connector="X", kv_role="kv_both", kv_connector_module_path="no.such.module"
            )
        )
    with pytest.raises(ValueError, match="not a KVConnectorBase subclass"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(
                kv_connector="FakeRequest", kv_role="kv_both", kv_connector_module_path=MODULE
            )
        )
    with pytest.raises(ValueError, match="not set"):
        KVConnectorFactory.get_connector_class(KVTransferConfig())
