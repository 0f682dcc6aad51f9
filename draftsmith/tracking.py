"""W&B set-up shared by training and benchmarks: offline mode when there is no network."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

log = logging.getLogger(__name__)


def network_available(host: str = "api.wandb.ai", port: int = 443, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def prepare_wandb_env(output_dir: str | Path) -> str:
    """Pick W&B offline mode when there is no network (an explicit WANDB_MODE wins)."""
    os.environ.setdefault("WANDB_SILENT", "true")
    if "WANDB_MODE" not in os.environ and not network_available():
        os.environ["WANDB_MODE"] = "offline"
        log.info("no network: W&B runs in offline mode (sync later with `wandb sync`)")
    return os.environ.get("WANDB_MODE", "online")
