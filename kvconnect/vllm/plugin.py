"""vLLM's general-plugin hook (entry point `vllm.general_plugins`, declared in pyproject.toml):
vLLM runs `register` in each of its processes at start.

It registers kvconnect's connector under its class name, so that

    --kv-transfer-config '{"kv_connector": "OffloadConnector", "kv_role": "kv_both", ...}'

works without `kv_connector_module_path`, and so that vLLM's MultiConnector, which looks its
children up by class name when it rebuilds their stats in the API server process, finds it.
Nothing is imported from kvconnect's connector until vLLM builds one.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

NAME = "OffloadConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, "kvconnect.vllm", NAME)
    except ValueError:  # already registered: this process ran the hook before, or vLLM has one
        logger.debug("vLLM already has a KV connector named %s", NAME)
