"""Finding connector classes by name: built-in ones, registered ones, out-of-tree ones.

`KVTransferConfig.kv_connector` names the class. With `kv_connector_module_path` set, the
class of that name is imported from that module (an out-of-tree connector); otherwise the
name is looked up among the registered connectors. Registration is lazy (module path and
class name), as in vLLM, so that importing the registry imports no connector.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

from kvconnect.config import KVTransferConfig
from kvconnect.connector.base import KVConnectorBase, KVConnectorContext, KVConnectorRole


class KVConnectorFactory:
    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Make `module_path.class_name` available as connector `name`; names are unique."""
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")
        cls._registry[name] = (module_path, class_name)

    @classmethod
    def registered_connectors(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase]:
        name = config.kv_connector
        if name is None:
            raise ValueError("KVTransferConfig.kv_connector is not set")
        if config.kv_connector_module_path:
            module_path, class_name = config.kv_connector_module_path, name
        elif name in cls._registry:
            module_path, class_name = cls._registry[name]
        else:
            known = ", ".join(cls.registered_connectors())
            raise ValueError(
                f"unknown KV connector {name!r}; registered: {known} "
                "(or set kv_connector_module_path for an out-of-tree connector)"
            )
        try:
            module = importlib.import_module(module_path)
        except ImportError as e:
            raise ValueError(f"cannot import KV connector module {module_path!r}: {e}") from e
        connector_cls = getattr(module, class_name, None)
        if not (isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase)):
            raise ValueError(f"{module_path}.{class_name} is not a KVConnectorBase subclass")
        return connector_cls

    @classmethod
    def create_connector(
        cls, context: KVConnectorContext, role: KVConnectorRole
    ) -> KVConnectorBase:
        """The connector `context.kv_transfer_config` names, built for `role`."""
        return cls.get_connector_class(context.kv_transfer_config)(context, role)


KVConnectorFactory.register_connector(
    "MultiConnector", "kvconnect.connector.multi", "MultiConnector"
)
KVConnectorFactory.register_connector(
    "OffloadConnector", "kvconnect.connector.offload.connector", "OffloadConnector"
)
