"""Every test, and every CLI run a test starts, keeps W&B offline: a developer's W&B login must not send test runs online."""

import pytest


@pytest.fixture(autouse=True)
def wandb_offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
