"""vLLM entry point (``vllm.general_plugins`` -> ``vllm_ddtree.plugin:register``).

vLLM calls :func:`register` in every process it starts (the API server, the
engine core and each worker), sometimes more than once. It is re-entrant: the
first call checks the vLLM version and installs the plugin's seams; later calls
do nothing.
"""

from __future__ import annotations

import threading

from vllm.logger import init_logger

from vllm_ddtree import __version__
from vllm_ddtree.version import check_vllm_version

logger = init_logger("vllm.ddtree")

_lock = threading.Lock()
_registered = False


def register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        found = check_vllm_version()
        from vllm_ddtree.setup_hooks import install

        installed = install()
        _registered = True
    seams = ", ".join(installed) if installed else "no seams installed"
    if "UNSUPPORTED" in found:
        logger.warning("vllm-ddtree %s loaded on %s: its patches were written for another "
                       "vLLM and may serve wrong tokens (%s)", __version__, found, seams)
    else:
        logger.info("vllm-ddtree %s loaded on %s (%s)", __version__, found, seams)
