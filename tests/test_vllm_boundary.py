"""kvconnect without vLLM: nothing outside `kvconnect.vllm` imports vLLM, and the plugin
package itself imports nothing from vLLM until vLLM asks for its connector."""

import pkgutil
import subprocess
import sys

import kvconnect


def test_no_module_outside_kvconnect_vllm_imports_vllm() -> None:
    names = [
        m.name
        for m in pkgutil.walk_packages(kvconnect.__path__, "kvconnect.")
        if not m.name.startswith("kvconnect.vllm")
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_plugin_package_and_hook_module_import_without_vllm() -> None:
    code = (
        "import sys, kvconnect.vllm, kvconnect.vllm.plugin\n"
        "assert 'vllm' not in sys.modules\n"
        "try:\n"
        "    kvconnect.vllm.OffloadConnector\n"
        "except ModuleNotFoundError as e:\n"
        "    assert e.name == 'vllm', e\n"
        "else:\n"
        "    raise AssertionError('vLLM is not installed here')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
